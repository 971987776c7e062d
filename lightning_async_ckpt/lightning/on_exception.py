"""``save_on_exception=True``: ``ModelCheckpoint``'s exception checkpoint, durable before the exception propagates.

Inside ``on_exception`` the checkpoint Lightning would save is copied at the cut
(:func:`capture_exception_checkpoint`), the saves in flight are drained, then it is written atomically and durably
at ``ModelCheckpoint``'s path (:func:`write_exception_checkpoint`). It holds whatever state the exception left, so
it is **not** a committed generation: ``ckpt_path="last"`` never resumes from it. Rank 0 writes it; sharded
strategies skip it with a warning.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_async_ckpt.lightning.naming import model_key_for
from lightning_async_ckpt.lightning.triggers import monitor_candidates
from lightning_async_ckpt.storage.backend import open_filesystem
from lightning_async_ckpt.storage.io import atomic_local_write

__all__ = ["ExceptionCheckpoint", "capture_exception_checkpoint", "should_save", "write_exception_checkpoint"]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass(frozen=True)
class ExceptionCheckpoint:
    """The exception checkpoint, serialized at the cut.

    Attributes:
        path: ``ModelCheckpoint``'s path for it (``format_checkpoint_name`` of the metrics at the exception).
        data: The bytes of ``torch.save`` of the checkpoint.
        stands_in_for: The step of an admitted save it replaces when that save does not commit (written only
            then); ``None``: written in any case.
    """

    path: str
    data: bytes
    stands_in_for: int | None = None


def should_save(cb: Any, trainer: Any) -> bool:
    """``ModelCheckpoint._should_save_on_exception`` during ``fit``: not in a sanity check, not with
    ``fast_dev_run``, not before the first step, and not when the callback's ``ModelCheckpoint`` schedule already
    saved this step (the final checkpoint of ``save_on_train_end`` is not such a save: ``ModelCheckpoint`` writes no
    file there)."""
    return _may_save(cb, trainer) and cb._model_checkpoint_step != trainer.global_step


def _may_save(cb: Any, trainer: Any) -> bool:
    return (
        bool(cb.save_on_exception)
        and not bool(trainer.fast_dev_run)
        and not trainer.sanity_checking
        and trainer.state.fn == TrainerFn.FITTING
        and cb.dirpath is not None
    )


def capture_exception_checkpoint(cb: Any, trainer: Any) -> ExceptionCheckpoint | None:
    """Copy the exception checkpoint at the cut, on the writing rank (``None`` when nothing is to be written).

    Never raises: a failure is logged and the training exception is the one that propagates.
    """
    # A save of this step that has not committed yet may still be refused: copied too, written only if it is.
    step = trainer.global_step
    stands_in = _may_save(cb, trainer) and cb.requested_step == step and cb.committed_step != step
    if not (should_save(cb, trainer) or stands_in) or not trainer.is_global_zero:
        return None
    if model_key_for(trainer.strategy) is not None:
        rank_zero_warn(
            f"save_on_exception=True writes no checkpoint under {type(trainer.strategy).__name__}: a sharded checkpoint "
            "needs every rank, and only the rank that raised is here. Resume from the newest committed checkpoint "
            "(ckpt_path='last')"
        )
        return None
    try:
        path = cb.format_checkpoint_name(monitor_candidates(trainer))
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=cb.save_weights_only)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        step = None if should_save(cb, trainer) else trainer.global_step
        return ExceptionCheckpoint(path=str(path), data=buffer.getvalue(), stands_in_for=step)
    except Exception:  # noqa: BLE001 - the training exception is the one that propagates
        _log.warning("save_on_exception: could not copy the checkpoint at the exception", exc_info=True)
        return None


def write_exception_checkpoint(cb: Any, snapshot: ExceptionCheckpoint | None, exception: BaseException) -> str | None:
    """Write ``snapshot`` atomically and durably at its path (``None``: nothing to write); returns the path.

    Never raises: a failure is logged and the training exception is the one that propagates.
    """
    if snapshot is None or (snapshot.stands_in_for is not None and cb.committed_step == snapshot.stands_in_for):
        return None
    path = snapshot.path
    try:
        if "://" not in path or path.startswith("file://"):
            local = path.removeprefix("file://")
            os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
            atomic_local_write(local, snapshot.data)
        else:
            fs, fs_path = open_filesystem(path, cb.storage_options or {})
            fs.pipe_file(fs_path, snapshot.data)  # an object store publishes the upload when it completes
    except Exception:  # noqa: BLE001 - the training exception is the one that propagates
        _log.warning("save_on_exception: could not write %s", path, exc_info=True)
        return None
    if snapshot.stands_in_for is not None:
        _log.warning(
            "save_on_exception: the checkpoint of step %d was refused or failed before it committed; the state at the "
            "exception was written to %s instead (not a committed generation: load it with ckpt_path=<that path>)",
            snapshot.stands_in_for,
            path,
        )
    rank_zero_info(f"An {type(exception).__name__} was raised with message: {exception}, saved checkpoint to {path}")
    return path
