"""What the callback reports through Lightning: progress metrics, the budget estimate, the committed-step log."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_async_ckpt.core.interfaces import TrainingCheckpointer
from lightning_async_ckpt.lightning.naming import loadable_path

__all__ = [
    "ProgressReports",
    "estimate_checkpoint_bytes",
    "log_commit",
    "log_durable_lag",
    "log_final",
    "log_progress",
    "log_stopped",
    "preallocate",
    "training_started",
]

_log = logging.getLogger("lightning_async_ckpt")
# Optimizer state multiple of the parameters, for the budget check before the first step.
_OPTIMIZER_STATE_FACTOR = {"Adam": 2, "AdamW": 2, "SGD": 1, "RMSprop": 1, "Adagrad": 1}


def log_progress(
    pl_module: pl.LightningModule, ck: TrainingCheckpointer, requested_step: int | None, skipped: int, last: tuple
) -> tuple:
    """Publish the ``ckpt/*`` metrics that changed since ``last``; returns the new state to pass next time.

    Written directly where ``self.log(on_step=True, on_epoch=False)`` would put them (``callback_metrics``,
    ``logged_metrics`` as CPU tensors, the progress bar, the loggers at Lightning's own flush), because each
    ``LightningModule.log`` call costs the training thread about 2 ms of result-collection bookkeeping.
    """
    trainer = pl_module.trainer
    committed_step = ck.committed_step
    record = ck.last_committed
    state = (requested_step, committed_step, skipped, ck.outstanding, id(record) if record is not None else None)
    known = len(last) == len(state) + 1  # else the first call: nothing published yet
    values: dict[str, float] = last[-1] if known else {}  # replaced, never mutated: the hot path copies nothing
    if state != last[: len(state)]:
        before = last if known else (None,) * len(state)
        metrics = {"ckpt/requested_step": requested_step, "ckpt/backlog": ck.outstanding, "ckpt/skipped": skipped}
        changed = {
            k: v for (k, v), old in zip(metrics.items(), (before[0], before[3], before[2]), strict=True) if v != old
        }
        if record is not None and state[4] != before[4]:
            changed.update(
                {
                    "ckpt/blocked_s": record.blocked_s,
                    "ckpt/staging_s": record.staging_s,
                    "ckpt/cut_to_committed_s": record.cut_to_committed_s,
                    "ckpt/bytes": record.bytes,
                    # What the steps felt (the background work competes for the cores), not only the hooks' time.
                    "ckpt/step_slowdown_s": getattr(record, "step_slowdown_s", None),
                }
            )
        if committed_step is not None and committed_step != before[1]:
            changed["ckpt/committed_step"] = committed_step
        changed = {k: float(v) for k, v in changed.items() if v is not None}
        values = {**values, **changed}
        tensors = {k: torch.tensor(v) for k, v in changed.items() if k != "ckpt/committed_step"}
        if "ckpt/committed_step" in changed:
            tensors["ckpt/committed_step"] = torch.tensor(int(committed_step), dtype=torch.int64)
            # An integer: Lightning turns a logged number into a float, and the TQDM bar would show `12.00`.
            trainer.progress_bar_metrics["ckpt/committed_step"] = int(committed_step)
        trainer.callback_metrics.update(tensors)
        trainer.logged_metrics.update(tensors)
    if values and _flushes_step_metrics(trainer):
        trainer._logger_connector.log_metrics({k: torch.tensor(v) for k, v in values.items()})
    return (*state, values)


def log_durable_lag(trainer: pl.Trainer, lag: int) -> None:
    """With ``local_dirpath``: ``ckpt/durable_lag``, the due generations not yet promoted to ``dirpath``, into the
    trainer's metrics and the loggers when it changed (the promoter warns past ``LAG_WARN_GENERATIONS``)."""
    last = trainer.callback_metrics.get("ckpt/durable_lag")
    if last is not None and int(last) == lag:
        return
    value = torch.tensor(lag, dtype=torch.int64)
    trainer.callback_metrics["ckpt/durable_lag"] = trainer.logged_metrics["ckpt/durable_lag"] = value
    if trainer.loggers:
        trainer._logger_connector.log_metrics({"ckpt/durable_lag": float(lag)})


def _flushes_step_metrics(trainer: pl.Trainer) -> bool:
    """Whether Lightning sends its step metrics to the loggers at the end of this batch (mirrors its own check)."""
    if not trainer.loggers:
        return False
    if trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization:
        return False
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def log_final(trainer: pl.Trainer, committed_step: int | None, *, to_loggers: bool) -> None:
    """After the final drain: an INFO line naming the final committed step, and that step as the last word.

    ``self.log`` is refused where the last saves commit, so the final ``ckpt/committed_step`` goes to every logger and
    the trainer's metric dicts directly (``to_loggers=False``: only the INFO line).
    """
    if trainer.is_global_zero:
        rank_zero_info(f"final committed checkpoint step {committed_step} (every save drained)")
    if committed_step is None or not to_loggers:
        return
    trainer._logger_connector.log_metrics({"ckpt/committed_step": float(committed_step)})
    trainer.progress_bar_metrics["ckpt/committed_step"] = committed_step
    final = torch.tensor(int(committed_step), dtype=torch.int64)
    trainer.logged_metrics["ckpt/committed_step"] = trainer.callback_metrics["ckpt/committed_step"] = final


def training_started(trainer: pl.Trainer) -> bool:
    """Whether a fit's training loop had started a batch (so an exception now stops training).

    False outside ``fit`` (validate, test, predict), during the sanity check, and before the first batch (setup,
    ``on_train_start``, the budget check).
    """
    state = trainer.state
    return (
        state.fn == TrainerFn.FITTING
        and state.stage != RunningStage.SANITY_CHECKING
        and trainer.fit_loop.epoch_loop.batch_progress.total.started > 0
    )


def log_stopped(
    trainer: pl.Trainer, exception: BaseException, committed_step: int | None, requested_step: int | None
) -> None:
    """Log at WARNING what an exception meant for checkpoints; it says "training stopped" only when it did."""
    if training_started(trainer):
        _log.warning(
            "training stopped by %s; last committed checkpoint step %s (last requested %s)",
            type(exception).__name__,
            committed_step,
            requested_step,
        )
        return
    fn, stage = trainer.state.fn, trainer.state.stage
    if fn == TrainerFn.FITTING:
        where = "fit, " + (
            "in the sanity check" if stage == RunningStage.SANITY_CHECKING else "before any training step"
        )
    else:
        where = f"{fn.value if fn else 'the trainer'}, not training"
    _log.warning(
        "%s raised during %s; last committed checkpoint step %s", type(exception).__name__, where, committed_step
    )


def estimate_checkpoint_bytes(module: torch.nn.Module, optimizers: list[Any]) -> int:
    """Parameters, buffers and optimizer state (estimated from the optimizer class before its first step)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    state = 0
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)
        present = sum(
            v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        owned = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
        state += present or owned * _OPTIMIZER_STATE_FACTOR.get(type(opt).__name__, 2)
    return params + buffers + state


def log_commit(future: Any) -> None:
    """A done-callback of the ``committed`` future (``verbose=True``): the committed step, through Lightning's
    ``rank_zero_info`` like ``ModelCheckpoint``'s verbose lines (visible wherever Lightning's own lines are)."""
    if not future.cancelled() and future.exception() is None:
        manifest = future.result()
        rank_zero_info(f"committed checkpoint step {manifest.step} ({manifest.total_bytes} bytes)")


def preallocate(ck: TrainingCheckpointer, pl_module: pl.LightningModule, optimizers: list[Any]) -> None:
    """Fill the staging pool in the background once the checkpoint's shape is known (after the first step).

    The first cut then reuses buffers instead of allocating them on the training thread. Built from the module's and
    optimizers' own state dicts: no collective and no user hook runs here.
    """
    try:
        state = {"state_dict": pl_module.state_dict(), "optimizer_states": [o.state_dict() for o in optimizers]}
        ck.preallocate(state, modules=[pl_module], optimizers=optimizers)
    except Exception as exc:  # noqa: BLE001 - an optimization only: the cut allocates (and checks) as before
        _log.warning("could not pre-allocate the staging buffers (%s); the first cut allocates them", exc)


class ProgressReports:
    """The callback's progress bookkeeping: the committed step it reports, its ``ckpt/*`` metrics, and the path a
    committed generation loads from (mixed into :class:`~lightning_async_ckpt.lightning.AsyncCheckpointCallback`)."""

    checkpointer: Any
    store: Any
    tiers: Any
    committed_step: int | None
    log_metrics: bool
    requested_step: int | None
    skipped: int
    _logged: tuple

    def _path_of(self, manifest: Any, store: Any = None) -> str:
        store = store or (self.store if self.tiers is None else self.tiers.local_store)
        assert store is not None
        return loadable_path(manifest, store)

    def _sync_progress(self) -> None:
        if self.checkpointer is not None:
            self.committed_step = self.checkpointer.committed_step

    def _log_progress(self, pl_module: pl.LightningModule) -> None:
        self._sync_progress()
        if self.checkpointer is not None and self.log_metrics:
            ck, logged = self.checkpointer, self._logged
            self._logged = log_progress(pl_module, ck, self.requested_step, self.skipped, logged)
            lag = None if self.tiers is None else getattr(self.tiers.promoter, "lag", None)
            if lag is not None:  # the DCP tiers' promoter does not count its lag
                log_durable_lag(pl_module.trainer, lag)
