"""``save_on_exception=True``: ``ModelCheckpoint``'s exception checkpoint, durable before the exception propagates.

When an exception reaches Lightning during ``fit`` (a training step, a hook, another callback), ``ModelCheckpoint``
writes the state of that moment to ``format_checkpoint_name(metrics)`` (``<dirpath>/<rendered filename>.ckpt``,
e.g. ``<dirpath>/exception.ckpt`` for ``filename="exception"``) unless it already saved that step, during sanity
checks, with ``fast_dev_run`` and before the first step. The callback writes the same file at the same path, in three steps inside
``on_exception``:

1. **copy at the cut** (:func:`capture_exception_checkpoint`): the checkpoint Lightning would save is dumped and
   serialized to bytes on the training thread right away, before anything else runs (no deferral: nothing is
   left to stage later);
2. the saves already in flight are drained (committed) by the callback, within ``drain_timeout_s``;
3. **written** (:func:`write_exception_checkpoint`): atomically and durably (a local path: temp file in the same
   folder, fsync, ``os.replace``, fsync the folder; an object store: one upload with the callback's
   ``storage_options``), before ``on_exception`` returns, so before the exception propagates.

What it holds is whatever state the exception left: the step counters, model, optimizer and loops as they were
when it was raised, possibly half-way through a step (after ``backward``, before the optimizer step), exactly as
``ModelCheckpoint``'s file does. It is therefore **not** a committed generation: ``ckpt_path="last"`` and
``latest_checkpoint`` never resume from it (they keep returning the newest consistent cut); load it explicitly
(``ckpt_path=<that path>``). Rank 0 writes it (the rank that raised, under DDP, if it is rank 0: no collective is
entered while an exception unwinds); sharded strategies skip it with a warning (their checkpoint needs every rank).

A save of this very step that was admitted but does not commit (the guard refused it: validation wrote its deferred
state before the copy, then raised) is not lost: ``ModelCheckpoint`` counts that step as saved and writes no exception
file, but here the exception checkpoint is written instead, with a warning that says so. It is the state at the
exception (what it is), not the refused cut.
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
