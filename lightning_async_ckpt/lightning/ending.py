"""Where the last checkpoint of a fit is taken: a stop seen after its batch end, the end of training, the emergency
save (the rules of ``docs/concepts.md``, "Which rule applies where").

A checkpoint is never labelled as a step it is not: inside an accumulation window no final or emergency checkpoint
is taken, and a stop decided after the batch end takes it where ``ModelCheckpoint``'s own save would be.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_async_ckpt.lightning.hooks import inside_accumulation_window, stops_here
from lightning_async_ckpt.lightning.preemption import Emergency, EmergencyWindow, warn_mid_window
from lightning_async_ckpt.lightning.schedule import CutSchedule

__all__ = ["TrainingEnds"]


class TrainingEnds:
    """The callback's end-of-fit cuts (mixed into :class:`~lightning_async_ckpt.lightning.AsyncCheckpointCallback`,
    whose ``_cut``, ``_skip``, ``_poll`` and ``_sync_progress`` they call). Training thread only."""

    checkpointer: Any
    tiers: Any
    options: Any
    committed_step: int | None
    save_on_train_end: bool
    _schedule: CutSchedule
    _last_cut_step: int | None
    _emergency_window: EmergencyWindow

    def _final_at_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The final cut, when no earlier hook saw the end (a stop set after this callback's on_train_epoch_end), is
        # taken in on_train_end, after epoch-end bookkeeping and every other callback's on_train_end: written as what
        # it is. It is skipped when that very step was admitted already (a skipped or coalesced request does not
        # count); it waits for admission whatever the policy.
        if not self.save_on_train_end or trainer.fast_dev_run:
            return
        if inside_accumulation_window(trainer):  # never a step it is not: no final checkpoint, and the log says so
            if self._schedule.last_admitted_step != trainer.global_step:
                self._sync_progress()
                warn_mid_window(trainer, "training stopped", "final", self.committed_step)
            return
        if self._schedule.last_admitted_step != trainer.global_step:
            self._cut(trainer, pl_module, trainer.global_step, final=True)
        self._retake_now(trainer, pl_module)

    def _final_at_stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # In on_validation_end and on_train_epoch_end: a stop decided after the batch end.
        if not (self.save_on_train_end and stops_here(trainer)) or self._skip(trainer, cut_too=False):
            return
        if inside_accumulation_window(trainer):
            return  # on_train_end says so
        if self._schedule.last_admitted_step != trainer.global_step:
            return self._cut(trainer, pl_module, trainer.global_step, final=True)
        self._retake_now(trainer, pl_module)

    def _retake_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A final save is copied at the cut, so the guard cannot refuse it; a refused earlier save of this very step
        # (a deferred scheduled save) is retaken now, copied at the cut. Every rank asks (a broadcast in DDP); only the
        # writing rank has a checkpointer to drain.
        if self.checkpointer is not None:
            self.checkpointer.drain_quietly(self.options.drain_timeout_s)
        if self._schedule.retake_due(trainer, self.checkpointer):
            self._cut(trainer, pl_module, trainer.global_step, final=True)

    def _emergency(self, trainer: pl.Trainer, pl_module: pl.LightningModule, point: Emergency) -> None:
        # A signal asked for a checkpoint now: copied at the cut, committed (locally first, then promoted) within
        # preemption_grace_s, then training stops; inside an accumulation window at the window's end.
        trainer.should_stop = trainer.should_stop or point is not Emergency.WAIT
        if point is Emergency.EXPIRED:  # the grace period ended inside the window: none, and the log says so
            self._sync_progress()
            warn_mid_window(trainer, "preemption_grace_s ended", "emergency", self.committed_step)
        if point is not Emergency.NOW:  # WAIT: for the window's end
            return self._poll(trainer)
        if not self._skip(trainer):
            self._cut(trainer, pl_module, trainer.global_step, final=True)
        if self.checkpointer is not None:  # the cut of this step (maybe taken locally already) made durable, drained
            self.checkpointer.emergency_save(trainer.global_step, None, grace_s=self._emergency_window.left())
        self._poll(trainer)
