"""What ``ckpt_path="last"`` may resume from, and a hard-coded ``<dirpath>/last.ckpt`` (no such file is written)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from lightning_async_ckpt.lightning.naming import comparable_path, run_locations

__all__ = ["LAST_FILE", "stand_in_for_last", "warn_if_weights_only", "weights_only"]

_log = logging.getLogger("lightning_async_ckpt")
LAST_FILE = "last.ckpt"  # the path resubmit scripts hard-code
_EXTRA_KEY = "model_checkpoint"  # selection.EXTRA_KEY: what the callback records about a generation


def weights_only(manifest: Any) -> bool:
    """Whether the callback wrote the generation with ``save_weights_only=True`` (no state to resume training)."""
    return bool((manifest.extra.get(_EXTRA_KEY) or {}).get("weights_only"))


def warn_if_weights_only(dirpath: str, storage_options: dict[str, Any] | None) -> None:
    """Warn (naming ``save_weights_only``) when ``dirpath`` or its versions hold weights-only generations."""
    steps = [
        info.step
        for loc in run_locations(dirpath, storage_options)
        for info in loc.store.generations()
        if info.manifest is not None and weights_only(info.manifest)
    ]
    if steps:
        message = (
            f"ckpt_path='last': the committed checkpoints in {dirpath!r} (newest step {max(steps)}) were written "
            "with save_weights_only=True and hold no optimizer or loop state to resume training from; like "
            "ModelCheckpoint without a last checkpoint, training starts fresh. Pass save_weights_only=False to "
            f"resume later; load these weights with load_from_checkpoint(latest_checkpoint({dirpath!r}))"
        )
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=4)


def stand_in_for_last(fs: Any, dirpath: str, path: Any, newest: Callable[[], str | None] | None) -> str | None:
    """For a ``<dirpath>/last.ckpt`` that does not exist on ``fs``: the checkpoint ``ckpt_path="last"`` resumes from.

    Returns ``None`` for any other path (and for a ``last.ckpt`` that exists: a ``ModelCheckpoint``'s file), or
    when ``newest`` is ``None``.

    Raises:
        FileNotFoundError: Nothing to resume from: the message names ``ckpt_path="last"`` and
            ``latest_checkpoint(dirpath)``.
    """
    parent, _, base = str(path).rstrip("/").rpartition("/")
    if newest is None or base != LAST_FILE or comparable_path(parent) != comparable_path(dirpath):
        return None
    if fs.exists(str(path)):
        return None
    found = newest()
    if found is None:
        raise FileNotFoundError(
            f"{path} does not exist: AsyncCheckpointCallback writes no last.ckpt file (a checkpoint is the "
            f"folder of its step, recoverable once its manifest is committed) and {dirpath!r} holds no "
            "checkpoint to resume training from. Pass trainer.fit(..., ckpt_path='last') (a fresh start while "
            f"there is none) or ckpt_path=latest_checkpoint({dirpath!r})"
        )
    _log.info("%s does not exist (no last.ckpt is written): loading %s, what ckpt_path='last' picks", path, found)
    return found
