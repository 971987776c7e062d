"""Lightning integration: ``AsyncCheckpointCallback`` and ``latest_checkpoint``.

Where each hook sits in one training step of automatic optimization (lightning 2.6)::

    on_train_batch_start   <- fence: buffers (and parameters/optimizer state when deferral is unproven)
    training_step          (forward: BatchNorm stats, dropout RNG mutate; backward)
    on_before_optimizer_step  <- fence: parameters and optimizer state, when proven
    optimizer update, step-interval LR schedulers
    on_train_batch_end     <- the cut: the checkpoint ModelCheckpoint(every_n_train_steps) would write

With ``accumulate_grad_batches=k`` ``on_before_optimizer_step`` fires only before real updates, so the fence moves
with it.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_async_ckpt.core.capture import DeferralProof, Fence, prove_deferral
from lightning_async_ckpt.core.engine import AsyncCheckpointer, CheckpointOptions
from lightning_async_ckpt.errors import ConfigError, GenerationExistsError
from lightning_async_ckpt.lightning.collective import agree_on
from lightning_async_ckpt.lightning.hooks import Window, override_failures
from lightning_async_ckpt.lightning.resume import latest_checkpoint
from lightning_async_ckpt.lightning.rng import collect_portable_rng, restore_rng
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["CHECKPOINT_NAME", "AsyncCheckpointCallback", "latest_checkpoint"]

_log = logging.getLogger("lightning_async_ckpt")
CHECKPOINT_NAME = "checkpoint.ckpt"
# Optimizer state multiple of the parameters, for the budget check before the first step.
_OPTIMIZER_STATE_FACTOR = {"Adam": 2, "AdamW": 2, "SGD": 1, "RMSprop": 1, "Adagrad": 1}


class AsyncCheckpointCallback(ModelCheckpoint):
    """Checkpoints that cost the training loop almost nothing and are never reported before they are recoverable.

    At each cut (``on_train_batch_end`` every ``every_n_train_steps`` optimizer steps, or the end of every
    ``every_n_epochs``-th epoch) the callback builds the same checkpoint ``ModelCheckpoint`` would write, copies at
    the cut what may mutate soon (counters, RNG, Python objects, buffers unless fenced, anything unproven), and stages
    parameters and optimizer state into reusable host buffers while the next forward/backward runs, waiting for them
    in ``on_before_optimizer_step`` only where that is proven safe. The snapshot is streamed through fsspec to
    ``dirpath`` and becomes recoverable when its manifest is written last.

    Logged through the Trainer's loggers: ``ckpt/requested_step``, ``ckpt/committed_step`` (also in the progress
    bar), ``ckpt/blocked_s``, ``ckpt/staging_s``, ``ckpt/cut_to_committed_s``, ``ckpt/bytes``, ``ckpt/backlog``,
    ``ckpt/skipped``. Only ``committed_step`` is recoverable progress.

    It subclasses ``ModelCheckpoint`` for one reason: Lightning resolves ``trainer.fit(ckpt_path="last")`` only through
    ``ModelCheckpoint`` instances, and this callback answers that lookup with the newest *committed* checkpoint. Every
    hook ``ModelCheckpoint`` implements is overridden here, so none of its synchronous saving runs.

    Args:
        dirpath: Local folder or fsspec URL (``s3://bucket/prefix``). Default: ``<default_root_dir>/checkpoints``.
        every_n_train_steps: Take a cut every N optimizer steps.
        every_n_epochs: Take a cut at the end of every N-th training epoch. Default 1 when neither interval is set.
        save_on_train_end: Take a final cut when training ends (if that step was not saved already).
        keep_last: Committed generations to keep; ``None`` keeps all.
        admission: When a cut arrives while ``max_outstanding`` saves are in flight: ``wait``, ``skip``,
            ``coalesce`` or ``abort``.
        max_outstanding: Saves in flight at once.
        host_memory_budget: Bytes, ``"auto"`` (half the available host memory) or ``None`` (unbounded).
        reserved_host_bytes: Host bytes other consumers need, subtracted from the budget.
        defer: ``False`` copies everything at the cut (no fences needed).
        storage_options: fsspec options for ``dirpath`` (e.g. S3 endpoint, credentials).
        on_error: ``raise`` a failed save on the training thread at the next hook, or ``warn`` and keep training.
        retries: Extra upload attempts on transient storage errors.
        drain_timeout_s: Bound on draining at exceptions and interpreter exit.
        upload_nice: Nice value (0-19, Linux) of the upload thread; higher lets the training threads go first.
        event_log: Path or URL of a JSONL event log (for ``lightning-async-ckpt timeline`` / ``plan``).
        restore_rng: Restore the RNG states captured at the cut when resuming (Lightning itself does not).
        verbose: Log every committed generation at INFO level.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_on_train_end: bool = True,
        keep_last: int | None = None,
        admission: Literal["wait", "skip", "coalesce", "abort"] = "wait",
        max_outstanding: int = 1,
        host_memory_budget: int | str | None = "auto",
        reserved_host_bytes: int = 0,
        defer: bool = True,
        storage_options: dict[str, Any] | None = None,
        on_error: Literal["raise", "warn"] = "raise",
        retries: int = 2,
        drain_timeout_s: float = 120.0,
        upload_nice: int = 0,
        event_log: str | None = None,
        restore_rng: bool = False,
        verbose: bool = False,
    ) -> None:
        # ModelCheckpoint's own saving is disabled (save_top_k=0, no last) and all of its hooks are overridden.
        super().__init__(save_top_k=0, save_last=False, every_n_epochs=0)
        if dirpath is not None and (not isinstance(dirpath, str) or not dirpath.strip()):
            raise ConfigError(f"dirpath must be a non-empty path or URL string, got {dirpath!r}")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")
        for name, value in (
            ("save_on_train_end", save_on_train_end),
            ("defer", defer),
            ("restore_rng", restore_rng),
            ("verbose", verbose),
        ):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        if every_n_train_steps is None and every_n_epochs is None:
            every_n_epochs = 1
        # Validates admission, budget, keep_last, on_error, retries... with messages naming the parameter.
        self.options = CheckpointOptions(
            max_outstanding=max_outstanding,
            admission=admission,
            host_memory_budget=host_memory_budget,
            reserved_host_bytes=reserved_host_bytes,
            keep_last=keep_last,
            on_error=on_error,
            retries=retries,
            drain_timeout_s=drain_timeout_s,
            upload_nice=upload_nice,
            event_log=event_log,
        )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self._every_n_epochs = every_n_epochs  # read through ModelCheckpoint's `every_n_epochs` property
        self.save_on_train_end = save_on_train_end
        self.defer = defer
        self.storage_options = storage_options
        self.restore_rng = restore_rng
        self.verbose = verbose
        self.store: CheckpointStore | None = None
        self.checkpointer: AsyncCheckpointer | None = None
        self.run_id: str | None = None
        self.requested_step: int | None = None
        self.committed_step: int | None = None
        self.skipped = 0
        self._logged: tuple = ()
        self._distributed = False
        self._committed_before: set[int] = set()
        self._last_cut_step: int | None = None
        self._fit_closed = True
        self._last_admitted_step: int | None = None
        self._coalesce_pending = False
        self._coalesce_polled: int | None = None
        self._last_handle: Any = None
        self._guard_pending = False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            dirpath=self.dirpath, every_n_train_steps=self.every_n_train_steps, every_n_epochs=self.every_n_epochs
        )

    # -- setup and teardown ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name = type(trainer.strategy).__name__
        if "FSDP" in name or "DeepSpeed" in name or "ModelParallel" in name:
            raise ConfigError(
                f"AsyncCheckpointCallback supports single-device and DDP strategies, not {name}: sharded strategies "
                "need every rank to write its shard; use ModelCheckpoint with that strategy's sharded checkpointing"
            )
        self._distributed = trainer.world_size > 1
        self._fit_closed = False
        if self.dirpath is None:
            self.dirpath = f"{trainer.default_root_dir.rstrip('/')}/checkpoints"
        if self.run_id is None:
            # One run id across ranks and across fit() calls of this callback, so retention sees one run.
            run_id = CheckpointStore.new_run_id()
            self.run_id = trainer.strategy.broadcast(run_id, src=0) if self._distributed else run_id
        error = None
        if trainer.is_global_zero and (self.checkpointer is None or self.checkpointer.closed):
            try:
                self.store = CheckpointStore(self.dirpath, self.storage_options, run_id=self.run_id)
                self.checkpointer = AsyncCheckpointer(self.store, self.options)
                self.checkpointer.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
                self._committed_before = {g.step for g in self.store.generations()}
            except Exception as exc:  # noqa: BLE001 - raised below on every rank
                error = exc
        agree_on(trainer, error, "setting up checkpointing")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Like ModelCheckpoint: no cut at the step training starts from (fresh: 0; resumed: the restored step).
        self._last_cut_step = trainer.global_step
        self._last_admitted_step = trainer.global_step
        self._coalesce_pending = False
        error = None
        if self.checkpointer is not None:
            # The budget is checked before the first step: optimizer state does not exist yet, so it is estimated.
            try:
                self.checkpointer.pool.check(_estimate_checkpoint_bytes(pl_module, trainer.optimizers))
            except Exception as exc:  # noqa: BLE001 - raised below on every rank
                error = exc
        agree_on(trainer, error, "checking the host-memory budget")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close(trainer, raise_errors=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # teardown is not called on exceptions: drain here so the in-flight save lands, within a bound.
        if self.checkpointer is not None:
            try:
                self.checkpointer.close(timeout=self.options.drain_timeout_s)
            except Exception:  # noqa: BLE001 - the training exception is the one that propagates
                _log.warning("checkpoint error while handling a training exception", exc_info=True)
            self._sync_progress()
            _log.warning(
                "training stopped by %s; last committed checkpoint step %s (last requested %s)",
                type(exception).__name__,
                self.committed_step,
                self.requested_step,
            )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """No-op: cuts are taken at training batch and epoch ends only (ModelCheckpoint would save here)."""

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Lightning's `ckpt_path="last"` lookup (before any hook runs): the newest committed checkpoint only.
        dirpath = self.dirpath or f"{str(trainer.default_root_dir).rstrip('/')}/checkpoints"
        try:
            path = latest_checkpoint(dirpath, self.storage_options)
        except Exception:  # noqa: BLE001 - "last" falls back to "no checkpoint" with Lightning's own warning
            _log.warning("could not look up the last committed checkpoint in %s", dirpath, exc_info=True)
            return set()
        return {path} if path else set()

    # -- fences ------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.checkpointer is not None:
            # In DDP, errors are raised only at collective points, so one rank never leaves the others hanging.
            self.checkpointer.wait(Fence.BATCH_START, raise_errors=not self._distributed)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait(Fence.OPTIMIZER_STEP, raise_errors=not self._distributed)

    # -- cuts --------------------------------------------------------------------------------------------
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.options.event_log is not None and self.checkpointer is not None:
            # Training progress beside the checkpoint events, for `lightning-async-ckpt timeline` (only when an
            # event log is configured: one JSON line per batch).
            self.checkpointer.events.emit("train_step", step=trainer.global_step, batch_idx=batch_idx)
        if self._skip(trainer):
            return
        step = trainer.global_step
        due = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        if not due and self._coalesce_pending and self._coalesce_polled != step:
            # A coalesced request takes a fresh cut once the backlog drained; polled once per step, and every
            # rank knows a coalesce is pending (the decision was broadcast), so all of them poll together.
            self._coalesce_polled = step
            due = self.checkpointer is not None and self.checkpointer.coalesce_due
            if self._distributed:
                due = bool(trainer.strategy.broadcast(due, src=0))
        retake = self._poll_guard(trainer)
        # The end of training is known here when max_steps is reached or this is the last batch of the last epoch:
        # the final checkpoint is taken now, before epoch-end bookkeeping and other callbacks' on_train_end (an EMA
        # callback copies its averaged weights into the model there), so it resumes like an uninterrupted run.
        final = self.save_on_train_end and _is_last_batch(trainer, batch_idx)
        if due or retake or final:
            self._cut(trainer, pl_module, step, final=final)
        self._log_progress(pl_module)

    def _poll_guard(self, trainer: pl.Trainer) -> bool:
        """Whether the newest admitted save was refused by the guard (torn) and must be retaken now.

        Polled at each batch end until that save's staging is resolved; in DDP rank 0 (the only one staging)
        decides and every rank learns it in one broadcast, so all ranks take the retake at the same step.
        """
        if not self._guard_pending:
            return False
        handle = self._last_handle
        resolved = handle is None or handle.staged.done()
        retake = bool(resolved and self.checkpointer is not None and self.checkpointer.retake_due)
        if self._distributed:
            resolved, retake = trainer.strategy.broadcast((resolved, retake), src=0)
        if resolved:
            self._guard_pending = False
            self._last_handle = None
        return retake

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._skip(trainer) or self.every_n_epochs is None:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._cut(trainer, pl_module, trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The final cut, when the end was not known at a batch end (early stopping, max_time, should_stop set by
        # user code), is taken here, after epoch-end bookkeeping and after every other callback's on_train_end: it
        # holds what they changed (see docs/concepts.md, "The final checkpoint"). It is skipped when that very step
        # was admitted already (a skipped or coalesced request does not count); it waits for admission whatever
        # the policy, so training ends recoverable.
        if self.save_on_train_end and not trainer.fast_dev_run and self._last_admitted_step != trainer.global_step:
            self._cut(trainer, pl_module, trainer.global_step, final=True)
        self._close(trainer, raise_errors=True)

    def _skip(self, trainer: pl.Trainer) -> bool:
        return (
            bool(trainer.fast_dev_run)
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
            or self._last_cut_step == trainer.global_step
        )

    def _cut(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, *, final: bool = False) -> None:
        if self._last_cut_step == step and not final:
            return
        self._last_cut_step = step
        clash = None
        if step in self._committed_before:
            clash = GenerationExistsError(
                f"dirpath {self.dirpath!r} already holds a committed checkpoint for step {step} from an earlier run; "
                "committed checkpoints are never overwritten: use a new dirpath, or resume with "
                "trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))"
            )
        self._raise_collectively(trainer, clash)
        self.requested_step = step
        decision, error = "admit", None
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            if self.checkpointer is not None:
                handle = self.checkpointer.save(
                    step,
                    checkpoint,
                    modules=[pl_module],
                    optimizers=trainer.optimizers,
                    proof=self._proof(trainer, pl_module) if self.defer else None,
                    defer=self.defer,
                    cut={"epoch": trainer.current_epoch, "global_step": step, "world_size": trainer.world_size},
                    admission="wait" if final else None,
                )
                decision = handle.decision.decision
                self._last_handle = handle
                if self.verbose:
                    handle.committed.add_done_callback(_log_commit)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
        # Every rank records rank 0's decision, and a capture failure on one rank fails all of them instead of
        # leaving the others waiting in the next collective.
        decision = agree_on(trainer, error, f"capturing the checkpoint for step {step}", decision)
        if decision in ("skip", "coalesce"):
            self.skipped += 1
        else:
            self._last_admitted_step = step
            self._guard_pending = self.defer
        self._coalesce_pending = decision == "coalesce" or (self._coalesce_pending and decision == "skip")

    def _raise_collectively(self, trainer: pl.Trainer, local: BaseException | None = None) -> None:
        # A background error from an earlier save is raised here, at a collective point, on every rank.
        if local is None and self.checkpointer is not None:
            local = self.checkpointer.take_pending_error()
        agree_on(trainer, local, "a checkpoint save")

    def _proof(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> DeferralProof:
        failures = override_failures(trainer, pl_module, self)
        if failures[Window.BEFORE_BATCH_START]:
            # No fence can protect state that user code may write right after the cut: copy it all at the cut.
            return DeferralProof(fences={}, rules=(), failures=tuple(failures[Window.BEFORE_BATCH_START]))
        return prove_deferral(
            [pl_module],
            trainer.optimizers,
            automatic_optimization=pl_module.automatic_optimization,
            extra_failures=failures[Window.BEFORE_OPTIMIZER_STEP],
        )

    def _close(self, trainer: pl.Trainer, *, raise_errors: bool) -> None:
        # Called from on_train_end and teardown; collective in DDP, so every rank runs it exactly once per fit.
        if self._fit_closed:
            return
        self._fit_closed = True
        error: BaseException | None = None
        if self.checkpointer is not None and not self.checkpointer.closed:
            try:
                self.checkpointer.close()
            except Exception as exc:  # noqa: BLE001 - raised below, after every rank took part in the collective
                error = exc
            self._sync_progress()
        try:
            self.committed_step = agree_on(trainer, error, "draining checkpoint saves", self.committed_step)
        except Exception:
            if raise_errors:
                raise

    # -- progress ----------------------------------------------------------------------------------------
    def _sync_progress(self) -> None:
        if self.checkpointer is not None:
            self.committed_step = self.checkpointer.committed_step

    def _log_progress(self, pl_module: pl.LightningModule) -> None:
        ck = self.checkpointer
        if ck is None:
            return
        self.committed_step = ck.committed_step
        state = (self.requested_step, self.committed_step, self.skipped, ck.outstanding)
        if state == self._logged:
            return  # logging is not free: only on change
        self._logged = state
        metrics = {
            "ckpt/requested_step": self.requested_step,
            "ckpt/backlog": ck.outstanding,
            "ckpt/skipped": self.skipped,
        }
        last = ck.last_committed
        if last is not None:
            metrics.update(
                {
                    "ckpt/blocked_s": last.blocked_s,
                    "ckpt/staging_s": last.staging_s,
                    "ckpt/cut_to_committed_s": last.cut_to_committed_s,
                    "ckpt/bytes": last.bytes,
                }
            )
        for key, value in metrics.items():
            if value is not None:
                pl_module.log(key, float(value), on_step=True, on_epoch=False, batch_size=1)
        if self.committed_step is not None:
            pl_module.log(
                "ckpt/committed_step",
                float(self.committed_step),
                on_step=True,
                on_epoch=False,
                prog_bar=True,
                batch_size=1,
            )

    # -- checkpoint state --------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # RNG states at the cut, in a form torch.load(weights_only=True) accepts.
        # The run id travels with the checkpoint, so a resumed run keeps it and keep_last reaches across restarts.
        return {"rng_states": collect_portable_rng(), "run_id": self.run_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        run_id = state_dict.get("run_id")
        if isinstance(run_id, str) and run_id:
            self.run_id = run_id
            if self.store is not None:
                self.store.run_id = run_id
        rng_states = state_dict.get("rng_states")
        if self.restore_rng and rng_states:
            restore_rng(rng_states)


def _is_last_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether training ends after this batch by its configured length (max_steps, or max_epochs' last batch)."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or trainer.current_epoch + 1 < max_epochs:
        return False
    return (
        bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch) or batch_idx + 1 >= trainer.num_training_batches
    )


def _estimate_checkpoint_bytes(module: torch.nn.Module, optimizers: list[Any]) -> int:
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


def _log_commit(future: Any) -> None:
    if not future.cancelled() and future.exception() is None:
        manifest = future.result()
        _log.info("committed checkpoint step %d (%d bytes)", manifest.step, manifest.total_bytes)
