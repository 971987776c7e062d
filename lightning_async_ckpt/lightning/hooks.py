"""The proof's hook tables: which Lightning hooks run between the cut and each fence (lightning 2.6, automatic
optimization), per role, and what an override of each one does to the deferral.

Derived from Lightning's actual call order by ``tests/core/test_proof_hooks.py``, which walks real Trainers (plain,
``accumulate_grad_batches``, ``val_check_interval`` mid-epoch, epoch boundaries with dataloader reloads, the
``max_steps`` end, batch-transfer hooks on the module or a datamodule) with a callback, a LightningModule and a
datamodule that override every hook name, and fails when a hook runs in a window without being listed here.

* :attr:`Window.BEFORE_BATCH_START`: from the cut (this callback's ``on_train_batch_end``) to its
  ``on_train_batch_start`` fence, or to the drain in its ``on_train_end`` after the last cut. Nothing is staged
  yet: a user override of a listed hook may write any state, so the whole checkpoint is copied at the cut.
* :attr:`Window.BEFORE_OPTIMIZER_STEP`: from the batch-start fence to this callback's
  ``on_before_optimizer_step`` fence. With ``accumulate_grad_batches=k`` it spans k micro-batches, including
  validation that runs between them. An override demotes parameters and optimizer state to the batch-start fence.

Hooks in :data:`COVERED` run in a window but do not demote on their own: every model overrides them
(``training_step``, ``forward``, ``validation_step``, the dataloader factories). Their writes are covered by the
forward scan of the proof (``nn.Embedding(max_norm=...)`` and friends are pinned to the cut) and by the runtime
guard (version counters and fingerprints).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_async_ckpt.core.proof import FINAL_PROOF, DeferralProof, prove_deferral

__all__ = [
    "COVERED",
    "FINAL_PROOF",
    "READ_ONLY_CALLBACKS",
    "WINDOWS",
    "Role",
    "Window",
    "inside_accumulation_window",
    "is_last_batch",
    "is_read_only",
    "lightning_proof",
    "override_failures",
    "stops_here",
    "training_ends_here",
]


class Role(str, Enum):
    """Who implements a hook."""

    CALLBACK = "callback"  # any other callback ordered before this one (the default order)
    LATER_CALLBACK = "later_callback"  # a callback ordered after this one (other checkpoint callbacks)
    MODULE = "module"
    DATAMODULE = "datamodule"


class Window(str, Enum):
    """The stretch of the loop between the cut and a fence."""

    BEFORE_BATCH_START = "before_batch_start"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"


_VALIDATION = (
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
)
_MODULE_VALIDATION = (
    *_VALIDATION,
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_validation_model_zero_grad",
)
_TRANSFER = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
_BACKWARD = ("on_before_backward", "on_after_backward", "on_before_zero_grad")

WINDOWS: dict[Window, dict[Role, frozenset[str]]] = {
    Window.BEFORE_BATCH_START: {
        Role.CALLBACK: frozenset(
            {
                "on_train_batch_start",  # callbacks before this one run their batch start before its fence
                "on_train_epoch_end",
                "on_train_epoch_start",
                *_VALIDATION,
                "on_train_end",  # other callbacks' on_train_end run before this one's drain
                "on_exception",  # likewise before the drain on an exception
            }
        ),
        Role.LATER_CALLBACK: frozenset(
            {"on_train_batch_end", "on_train_epoch_end", "on_train_epoch_start", *_VALIDATION, "on_exception"}
        ),
        Role.MODULE: frozenset(
            {
                "on_train_batch_end",  # module hooks run after the callbacks' ones: after the cut
                "on_train_epoch_end",
                "on_train_epoch_start",
                *_MODULE_VALIDATION,
                *_TRANSFER,
                "forward",
                "validation_step",
                "train_dataloader",
                "val_dataloader",
            }
        ),
        Role.DATAMODULE: frozenset({*_TRANSFER, "train_dataloader", "val_dataloader"}),
    },
    Window.BEFORE_OPTIMIZER_STEP: {
        Role.CALLBACK: frozenset(
            {*_BACKWARD, "on_before_optimizer_step", "on_train_batch_start", "on_train_batch_end", *_VALIDATION}
        ),
        Role.LATER_CALLBACK: frozenset({*_BACKWARD, "on_train_batch_start", "on_train_batch_end", *_VALIDATION}),
        Role.MODULE: frozenset(
            {
                "on_train_batch_start",
                "training_step",
                "forward",
                "backward",
                *_BACKWARD,
                "optimizer_step",  # wraps optimizer.step(closure): runs before the closure and the fence
                "optimizer_zero_grad",
                "on_train_batch_end",  # micro-batches of an accumulation
                *_MODULE_VALIDATION,
                "validation_step",
                *_TRANSFER,
            }
        ),
        Role.DATAMODULE: frozenset(_TRANSFER),
    },
}

COVERED: dict[Role, frozenset[str]] = {
    Role.CALLBACK: frozenset(),
    Role.LATER_CALLBACK: frozenset(),
    Role.MODULE: frozenset({"forward", "training_step", "validation_step", "train_dataloader", "val_dataloader"}),
    Role.DATAMODULE: frozenset({"train_dataloader", "val_dataloader"}),
}

# Lightning callbacks known to read parameters only. A callback of your own can declare the same with a class
# attribute `lightning_async_ckpt_read_only = True`.
READ_ONLY_CALLBACKS = (
    "ProgressBar",
    "ModelSummary",
    "LearningRateMonitor",
    "Timer",
    "EarlyStopping",
    "DeviceStatsMonitor",
    "ThroughputMonitor",
    "GradientAccumulationScheduler",
    "ModelCheckpoint",
)


def is_read_only(callback: Callback) -> bool:
    """Whether ``callback`` is known (or declares itself) never to write saved state."""
    if getattr(callback, "lightning_async_ckpt_read_only", False):
        return True
    return any(k.__name__ in READ_ONLY_CALLBACKS for k in type(callback).__mro__)


def _overrides(obj: Any, base: type, hook: str) -> bool:
    impl = getattr(type(obj), hook, None)
    return impl is not None and impl is not getattr(base, hook, None)


def override_failures(trainer: pl.Trainer, pl_module: pl.LightningModule, this: Callback) -> dict[Window, list[str]]:
    """The overrides of listed hooks by the module, the datamodule and every other callback, per window.

    Args:
        trainer: The trainer (its callbacks and datamodule are inspected).
        pl_module: The LightningModule.
        this: The checkpoint callback itself (skipped; callbacks after it take the later-callback tables).

    Returns:
        One failure message per override, for each window.
    """
    parties: list[tuple[Role, Any, type, str]] = [(Role.MODULE, pl_module, pl.LightningModule, "the LightningModule")]
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        parties.append((Role.DATAMODULE, datamodule, pl.LightningDataModule, "the LightningDataModule"))
    later = False
    for cb in trainer.callbacks:
        if cb is this:
            later = True
            continue
        if not is_read_only(cb):
            role = Role.LATER_CALLBACK if later else Role.CALLBACK
            parties.append((role, cb, Callback, f"callback {type(cb).__name__}"))
    failures: dict[Window, list[str]] = {w: [] for w in Window}
    where = {Window.BEFORE_BATCH_START: "before any fence", Window.BEFORE_OPTIMIZER_STEP: "before the next update"}
    for window, tables in WINDOWS.items():
        for role, obj, base, name in parties:
            for hook in sorted(tables[role] - COVERED[role]):
                if _overrides(obj, base, hook):
                    failures[window].append(f"{name} overrides {hook}, which runs {where[window]}")
    return failures


def is_last_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether training ends after this batch by its configured length (max_steps, or max_epochs' last batch).

    Called in ``on_train_batch_end``: when true, the final checkpoint is taken there, before the end-of-epoch
    bookkeeping and the other callbacks' ``on_train_end``. Ends decided later (early stopping, ``max_time``,
    ``should_stop``) are not known here.
    """
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or trainer.current_epoch + 1 < max_epochs:
        return False
    if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        return True
    return batch_idx + 1 >= trainer.num_training_batches


def stops_here(trainer: pl.Trainer) -> bool:
    """Whether ``should_stop`` ends training (``min_epochs``/``min_steps`` met) after the current point."""
    return bool(trainer.should_stop) and bool(getattr(trainer.fit_loop, "_can_stop_early", True))


def inside_accumulation_window(trainer: pl.Trainer) -> bool:
    """At a batch end (or after the last one): whether this micro-batch did not end its optimizer step, so the state
    holds part of the next step (its BatchNorm statistics, its accumulated gradient) under the previous step's
    number (``accumulate_grad_batches > 1``; Lightning's ``_should_accumulate``)."""
    if trainer.accumulate_grad_batches <= 1:
        return False
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def training_ends_here(trainer: pl.Trainer) -> bool:
    """Whether no training step follows the current point: a cut here is the fit's last one (copied at the cut).

    True at the last batch (``max_steps``, or the last epoch's last batch), at that epoch's end and its validation,
    and once ``should_stop`` was set (early stopping: conservatively, a stop that ``min_steps`` delays included).
    """
    return bool(trainer.should_stop) or is_last_batch(trainer, trainer.fit_loop.epoch_loop.batch_idx)


def lightning_proof(trainer: pl.Trainer, pl_module: pl.LightningModule, callback: Any) -> DeferralProof:
    """The deferral proof for this fit: the engine's rules plus what overridden hooks may write before a fence."""
    failures = override_failures(trainer, pl_module, callback)
    if failures[Window.BEFORE_BATCH_START]:
        # No fence can protect state that user code may write right after the cut: copy it all at the cut.
        return DeferralProof(fences={}, rules=(), failures=tuple(failures[Window.BEFORE_BATCH_START]))
    return prove_deferral(
        [pl_module],
        trainer.optimizers,
        automatic_optimization=pl_module.automatic_optimization,
        extra_failures=failures[Window.BEFORE_OPTIMIZER_STEP],
    )
