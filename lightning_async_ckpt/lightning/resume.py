"""Resuming: the newest checkpoint that is provably intact, for ``trainer.fit(ckpt_path=...)``."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["latest_checkpoint"]

_log = logging.getLogger("lightning_async_ckpt")


def latest_checkpoint(dirpath: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """Path of the newest committed, intact, Lightning-loadable checkpoint under ``dirpath``, or ``None``.

    The generation returned was verified: its manifest is valid and every object was read once and matched
    its size and checksum, so a truncated file or a flipped bit is never resumed from. A generation that fails
    is skipped with a warning naming the problem and the next older one is tried. Use it as
    ``trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))``. Verifying reads the checkpoint once more
    than loading does (see ``docs/benchmarks.md`` for the cost).

    Args:
        dirpath: The callback's ``dirpath`` (local folder or fsspec URL).
        storage_options: fsspec options for ``dirpath``.

    Returns:
        The URL of the checkpoint object, or ``None`` when ``dirpath`` was listed and holds no intact
        checkpoint (a local folder that does not exist yet is empty).

    Raises:
        StoreUnavailableError: ``dirpath`` cannot be listed (missing bucket, unreachable endpoint, no
            permission): a typo never silently restarts training from scratch.
    """
    from lightning_async_ckpt.lightning.callback import CHECKPOINT_NAME

    store = CheckpointStore(dirpath, storage_options, check_writable=False)
    for info in reversed(store.generations()):
        if info.manifest is None or CHECKPOINT_NAME not in {o.name for o in info.manifest.objects}:
            continue
        result = store.verify(info.step)
        if not result.ok:
            message = f"skipping generation {info.path}: {'; '.join(result.problems)}"
            _log.warning("%s", message)
            warnings.warn(message, stacklevel=2)
            continue
        return store.object_url(info.step, CHECKPOINT_NAME)
    return None
