"""When ``AsyncCheckpointCallback`` takes a cut: ``ModelCheckpoint``'s decision, hook by hook (lightning 2.6).

:class:`Triggers` applies ``ModelCheckpoint``'s rules: step and time intervals at a batch end (deferred to the next
``on_validation_end`` when the monitored metric is stale), epoch intervals at the train epoch end or validation end,
never twice at the same step, never outside fitting, during sanity checks or with ``fast_dev_run``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping

__all__ = ["Triggers", "monitor_candidates", "stop_may_follow"]


def monitor_candidates(trainer: pl.Trainer) -> dict[str, Any]:
    """``ModelCheckpoint._monitor_candidates``: the logged metrics plus ``epoch`` and ``step`` as int tensors."""
    candidates = dict(trainer.callback_metrics)
    epoch, step = candidates.get("epoch"), candidates.get("step")
    candidates["epoch"] = epoch.int() if isinstance(epoch, torch.Tensor) else torch.tensor(trainer.current_epoch)
    candidates["step"] = step.int() if isinstance(step, torch.Tensor) else torch.tensor(trainer.global_step)
    return candidates


class Triggers:
    """The save schedule of ``ModelCheckpoint`` for one callback (training thread only)."""

    def __init__(
        self,
        *,
        every_n_train_steps: int | None,
        every_n_epochs: int | None,
        train_time_interval: timedelta | None,
        save_on_train_epoch_end: bool | None,
        monitor: str | None,
    ) -> None:
        self.every_n_train_steps = every_n_train_steps or 0
        self.every_n_epochs = every_n_epochs or 0
        self.train_time_interval = train_time_interval
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.monitor = monitor
        self.deferred = False
        self.final_waits = False
        self._last_time_checked: float | None = None

    def __eq__(self, other: object) -> bool:
        # By value, like ModelCheckpoint's plain attributes: a pickled copy of the callback equals the original.
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def start(self) -> None:
        """``on_train_start``: the time interval counts from here."""
        self._last_time_checked = time.monotonic()
        self.deferred = False
        self.final_waits = False

    def final_waits_for_epoch_end(self, trainer: pl.Trainer) -> bool:
        """At the last batch of training: whether ``ModelCheckpoint`` saves this step at the epoch's end
        (``on_train_epoch_end``, or ``on_validation_end`` after the validation run that follows). The final
        checkpoint is then that save, taken there (after validation and the epoch-end bookkeeping, the file
        ``ModelCheckpoint`` writes), ranked with the metrics of that moment (recorded in ``final_waits``)."""
        if self.on_epoch_end_saves(trainer):
            waits = self.epoch_due(trainer)
        else:
            waits = validation_runs_next(trainer) and (self.deferred or self.epoch_due(trainer))
        self.final_waits = waits
        return waits

    def on_epoch_end_saves(self, trainer: pl.Trainer) -> bool:
        """``ModelCheckpoint._should_save_on_train_epoch_end``."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            return False
        if trainer.check_val_every_n_epoch != 1:
            return False
        num_val = trainer.num_val_batches
        if (sum(num_val) if isinstance(num_val, list) else num_val) == 0:
            return True
        return trainer.val_check_interval == 1.0

    def batch_end(self, trainer: pl.Trainer) -> bool:
        """Whether the interval or the timer is due at this batch end (may record a deferral instead)."""
        due_steps = self.every_n_train_steps >= 1 and trainer.global_step % self.every_n_train_steps == 0
        due_time = False
        if self.train_time_interval is not None:
            now = time.monotonic()
            last = self._last_time_checked
            due_time = last is not None and now - last >= self.train_time_interval.total_seconds()
            # Ranks' clocks differ: rank 0 decides, like ModelCheckpoint.
            due_time = bool(trainer.strategy.broadcast(due_time))
            if due_time:
                self._last_time_checked = now
        if not (due_steps or due_time):
            return False
        if self.monitor is not None and (
            self.monitor not in monitor_candidates(trainer)
            or (not self.on_epoch_end_saves(trainer) and _validation_follows(trainer))
        ):
            # The metric is missing, or stale with a validation run right after this batch: save after it.
            self.deferred = True
            return False
        return True

    def epoch_due(self, trainer: pl.Trainer) -> bool:
        """Whether this epoch is an ``every_n_epochs``-th one."""
        return self.every_n_epochs >= 1 and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def validation_end(self, trainer: pl.Trainer) -> str | None:
        """Whether to save in ``on_validation_end``: ``"deferred"`` (a deferred interval save: top k and last, like
        at a batch end), ``"epoch"`` (the epoch interval when saving there: top k only), or ``None``."""
        if self.on_epoch_end_saves(trainer):
            return None
        if self.deferred:
            self.deferred = False
            return "deferred"
        return "epoch" if self.epoch_due(trainer) else None

    def train_epoch_end(self, trainer: pl.Trainer) -> bool:
        """Whether to save in ``on_train_epoch_end``."""
        return self.on_epoch_end_saves(trainer) and self.epoch_due(trainer)


def validation_runs_next(trainer: pl.Trainer) -> bool:
    """Whether Lightning's loop runs validation right after this batch (``_TrainingEpochLoop._should_check_val_fx``
    for a batch whose end is known: the epoch's last batch, or a ``val_check_interval`` point, also before the
    validation loop ever ran); ``False`` when a time-based interval decides (unknown here)."""
    if not getattr(trainer, "enable_validation", False):
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every != 0:
        return False
    num_val = trainer.num_val_batches
    if isinstance(num_val, list) and num_val and not sum(num_val):  # known to be empty
        return False
    if trainer.should_stop and getattr(trainer.fit_loop, "_can_stop_early", True):
        return True  # a stop requested by this batch's code: Lightning validates before stopping
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return False
    loop = trainer.fit_loop.epoch_loop
    val_check_batch = trainer.val_check_batch
    if val_check_batch is None or val_check_batch == float("inf"):
        return bool(loop.batch_progress.is_last_batch)
    current = loop.total_batch_idx if every is None else loop.batch_idx
    return (current + 1) % val_check_batch == 0


def stop_may_follow(trainer: pl.Trainer) -> bool:
    """At a batch end: whether an ``EarlyStopping`` callback may stop training before the next training step (in the
    validation run that follows, or at this epoch's end). A cut here is copied at the cut: a retake after that stop
    would hold validation's and the epoch end's writes under this step's number."""
    if not any(isinstance(cb, EarlyStopping) for cb in trainer.callbacks):
        return False
    return validation_runs_next(trainer) or bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def _validation_follows(trainer: pl.Trainer) -> bool:
    # ModelCheckpoint.on_train_batch_end: the last batch of an epoch after which the validation loop runs.
    if not getattr(trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", False):
        return False
    if not getattr(trainer, "enable_validation", False):
        return False
    num_val = trainer.num_val_batches
    if not (sum(num_val) if isinstance(num_val, list) else num_val):
        return False
    every = trainer.check_val_every_n_epoch
    return every is None or (trainer.current_epoch + 1) % every == 0
