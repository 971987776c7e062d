"""Lightning integration: ``AsyncCheckpointCallback`` and ``latest_checkpoint``.

In one step of automatic optimization the cut is ``on_train_batch_end``; the fences are ``on_train_batch_start``
and ``on_before_optimizer_step`` (which fires only before real updates under gradient accumulation). Which other
hooks run in between, and what overriding them does to deferral, is in :mod:`lightning_async_ckpt.lightning.hooks`.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.lightning.arguments import (
    check_shared_dirpath,
    check_strategy,
    committed_clash,
    resolve_dirpath,
)
from lightning_async_ckpt.lightning.base import CallbackArguments
from lightning_async_ckpt.lightning.collective import agree_on
from lightning_async_ckpt.lightning.commits import cut_metrics, deliver, finish_exports, listen
from lightning_async_ckpt.lightning.ending import TrainingEnds
from lightning_async_ckpt.lightning.hooks import (
    FINAL_PROOF,
    inside_accumulation_window,
    is_last_batch,
    lightning_proof,
    stops_here,
    training_ends_here,
)
from lightning_async_ckpt.lightning.naming import CHECKPOINT_NAME, checkpoint_key, planned_path
from lightning_async_ckpt.lightning.on_exception import capture_exception_checkpoint, write_exception_checkpoint
from lightning_async_ckpt.lightning.preemption import Emergency, EmergencyWindow, restore_after_exception
from lightning_async_ckpt.lightning.progress import (
    ProgressReports,
    estimate_checkpoint_bytes,
    log_commit,
    log_final,
    log_stopped,
    preallocate,
)
from lightning_async_ckpt.lightning.rerun import place_run
from lightning_async_ckpt.lightning.resume import find_last, install_reader, remove_reader
from lightning_async_ckpt.lightning.selection import (
    after_model_checkpoints,
    rebuild_best_k,
)
from lightning_async_ckpt.lightning.sharded import setup_sharded
from lightning_async_ckpt.lightning.tier_resume import find_last_across, latest_checkpoint
from lightning_async_ckpt.lightning.tiers import open_checkpointer
from lightning_async_ckpt.lightning.triggers import monitor_candidates, stop_may_follow
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["CHECKPOINT_NAME", "AsyncCheckpointCallback", "latest_checkpoint"]

_log = logging.getLogger("lightning_async_ckpt")


class AsyncCheckpointCallback(TrainingEnds, ProgressReports, CallbackArguments):
    """Checkpoints that cost the training loop almost nothing and are never reported before they are recoverable.

    At each cut (``on_train_batch_end`` every ``every_n_train_steps`` optimizer steps, or the end of every
    ``every_n_epochs``-th epoch) the callback builds the same checkpoint ``ModelCheckpoint`` would write, copies at
    the cut what may mutate soon (counters, RNG, Python objects, buffers unless fenced, anything unproven), and stages
    parameters and optimizer state into reusable host buffers while the next forward/backward runs, waiting for them
    in ``on_before_optimizer_step`` only where that is proven safe. The snapshot is streamed through fsspec to
    ``dirpath`` and becomes recoverable when its manifest is written last.

    Logged through the Trainer's loggers: ``ckpt/requested_step``, ``ckpt/committed_step`` (also in the progress
    bar), ``ckpt/blocked_s``, ``ckpt/staging_s``, ``ckpt/cut_to_committed_s``, ``ckpt/bytes``, ``ckpt/backlog``,
    ``ckpt/skipped``. Only ``committed_step`` is recoverable progress; after the final drain its last value goes to every
    logger and the progress-bar metrics (``log_metrics=False`` logs none of them; ``docs/configuration.md``).

    It subclasses ``ModelCheckpoint`` for one reason: Lightning resolves ``trainer.fit(ckpt_path="last")`` only through
    ``ModelCheckpoint`` instances, and this callback answers that lookup with the newest *committed* checkpoint. Every
    hook ``ModelCheckpoint`` implements is overridden here, so none of its synchronous saving runs.

    Its arguments (``ModelCheckpoint``'s, in its positional order, then the library's own, keyword-only) are
    documented and validated on :class:`~lightning_async_ckpt.lightning.base.CallbackArguments`.
    """

    # -- setup and teardown ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A ModelCheckpoint listed beside this callback stays `trainer.checkpoint_callback` (its "best").
        trainer.callbacks = after_model_checkpoints(self, trainer.callbacks)
        install_reader(self, trainer)  # paths in dirpath load through the store's storage_options (resume.py)
        if stage != "fit":
            return
        check_strategy(trainer.strategy)
        self._distributed = trainer.world_size > 1
        self._fit_closed = False
        self.dirpath = resolve_dirpath(self.dirpath, trainer.default_root_dir)  # None: the default; "": the cwd
        check_shared_dirpath(self, trainer)
        if self.tiers is not None:
            self.tiers.setup(trainer)  # peer replicas' gloo group and receivers, on every rank (lightning/replicas.py)
        if self.run_id is None:
            # One run id across ranks and across fit() calls of this callback, so retention sees one run.
            run_id = CheckpointStore.new_run_id()
            self.run_id = trainer.strategy.broadcast(run_id, src=0) if self._distributed else run_id
        self.preemption.install()  # the emergency save's signal, when one is configured (lightning/preemption.py)
        self._sharded = setup_sharded(self, trainer, self._sharded)  # DCP: a writer on every rank (sharded.py)
        if self._sharded is not None:  # with local_dirpath: every rank's own local tier (sharded_tiers.py)
            self.checkpointer, self.store = self._sharded.checkpointer, self._sharded.store
            self._committed_before = self._sharded.committed
            return
        error = None
        if trainer.is_global_zero and (self.checkpointer is None or self.checkpointer.closed):
            try:
                self.store = CheckpointStore(self.dirpath, self.storage_options, run_id=self.run_id)
                self.checkpointer = open_checkpointer(self.store, self.options, self.tiers)  # tiers.py: local_dirpath
                self._committed_before = {g.step for g in self.store.generations()}
            except Exception as exc:  # noqa: BLE001 - raised below on every rank
                error = exc
        agree_on(trainer, error, "setting up checkpointing")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        placed = place_run(self, trainer)  # continue the resumed run, or a new version beside another run's
        self.run_id, self.resumed_location = placed.run_id, placed.resumed
        if placed.checkpointer is not None:
            self.store, self.checkpointer, self._committed_before = placed.store, placed.checkpointer, placed.committed
        if self.tiers is not None and self.store is not None:  # the local tier's location beside it (tiers.py)
            self.checkpointer = self.tiers.place(self.checkpointer, self.store, self.options, trainer.global_step)
        # Like ModelCheckpoint: no cut at the step training starts from (fresh: 0; resumed: the restored step).
        self._last_cut_step = self._fit_start_step = trainer.global_step
        self._preallocated = False
        self._emergency_window = EmergencyWindow(self.preemption_grace_s)
        self._schedule.start(trainer.global_step)
        self.triggers.start()
        if self.store is not None and trainer.ckpt_path is not None:
            rebuild_best_k(self, trainer.global_step)  # resumed: best-k from the committed manifests (selection.py)
        error = None
        if self.checkpointer is not None:
            # The budget is checked before the first step: optimizer state does not exist yet, so it is estimated.
            try:
                self.checkpointer.pool.check(estimate_checkpoint_bytes(pl_module, trainer.optimizers))
            except Exception as exc:  # noqa: BLE001 - raised below on every rank
                error = exc
        agree_on(trainer, error, "checking the host-memory budget")
        listen(self, trainer)  # commit records for on_commit / on_checkpoint_committed, when any (commits.py)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        remove_reader(self)
        self.preemption.remove()
        if stage == "fit":
            self._close(trainer, raise_errors=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # teardown is not called on exceptions: drain here so the in-flight save lands, within a bound. With
        # save_on_exception, ModelCheckpoint's exception file is copied first and written last (on_exception.py).
        snapshot = capture_exception_checkpoint(self, trainer)
        restore_after_exception(self.preemption, trainer)  # teardown does not run after an exception
        if self.checkpointer is not None:
            try:
                # The save in flight lands (locally, then its promotion and replicas), within the bound.
                self.checkpointer.close(timeout=self.options.drain_timeout_s)
            except Exception:  # noqa: BLE001 - the training exception is the one that propagates
                _log.warning("checkpoint error while handling a training exception", exc_info=True)
            self._sync_progress()
            log_stopped(trainer, exception, self.committed_step, self.requested_step)
        write_exception_checkpoint(self, snapshot, exception)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Where ModelCheckpoint saves when validation does not run once per epoch end (lightning/triggers.py).
        kind = None if self._skip(trainer) else self.triggers.validation_end(trainer)
        if kind is not None:
            final = self.triggers.final_waits
            self._cut(trainer, pl_module, trainer.global_step, final=final, ranked=True, last=kind == "deferred")
        if not self.triggers.train_epoch_end(trainer):  # else the epoch end's save is the final one
            self._final_at_stop(trainer, pl_module)
        self._poll(trainer)

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Lightning's `ckpt_path="last"` lookup (before any hook runs): the newest committed checkpoint only.
        # A store that cannot be listed raises (a typo must never restart training from scratch); "no checkpoint"
        # means it was listed and holds no committed generation.
        return find_last(self, trainer) if self.tiers is None else find_last_across(self, trainer)

    # -- fences ------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.checkpointer is not None:
            # In DDP, errors are raised only at collective points, so one rank never leaves the others hanging.
            self.checkpointer.wait(Fence.BATCH_START, raise_errors=not self._distributed)
            self._poll(trainer)

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
        step_cut = self._last_cut_step == trainer.global_step
        emergency = self._emergency_window.point(self.preemption, trainer, step_cut=step_cut)
        if emergency is not Emergency.NONE:
            return self._emergency(trainer, pl_module, emergency)
        if self._skip(trainer):
            return
        step = trainer.global_step
        ranked = self.triggers.batch_end(trainer)  # ModelCheckpoint's interval and timer (lightning/triggers.py)
        # A coalesced request takes a fresh cut once the backlog drained; the local tier has its own cadence.
        due = ranked or self._schedule.coalesce_due(trainer, self.checkpointer, step)
        due = due or (self.tiers is not None and self.tiers.local_due(step))
        # A save the guard refused is retaken at the first batch end after its verdict.
        retake = self._schedule.retake_due(trainer, self.checkpointer)
        # The end of training is known here when max_steps is reached or this is the last batch of the last epoch:
        # the final checkpoint is taken now, before epoch-end bookkeeping and other callbacks' on_train_end (an EMA
        # callback copies its averaged weights into the model there), so it resumes like an uninterrupted run.
        # When the schedule saves this step at the epoch's end (after validation), the final cut is that save.
        # So is a stop set before this hook (in training_step, or by an earlier callback), unless mid-window.
        final = (
            self.save_on_train_end
            and (is_last_batch(trainer, batch_idx) or (stops_here(trainer) and not inside_accumulation_window(trainer)))
            and not self.triggers.final_waits_for_epoch_end(trainer)
        )
        if due or retake or final:
            self._cut(trainer, pl_module, step, final=final, ranked=ranked)
        elif (
            not self._preallocated
            and self.checkpointer is not None
            and self._sharded is None  # sharded: allocated at the first cut (local shards, not DTensors)
            and step > self._fit_start_step
        ):
            self._preallocated = True
            preallocate(self.checkpointer, pl_module, trainer.optimizers)
        self._poll(trainer)
        self._log_progress(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._skip(trainer) and self.triggers.train_epoch_end(trainer):
            final = self.triggers.final_waits
            self._cut(trainer, pl_module, trainer.global_step, final=final, ranked=True, last=False)
        self._final_at_stop(trainer, pl_module)
        self._poll(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._final_at_train_end(trainer, pl_module)  # unless an earlier hook took it (lightning/ending.py)
        self._close(trainer, raise_errors=True)

    def _skip(self, trainer: pl.Trainer, *, cut_too: bool = True) -> bool:
        return (
            bool(trainer.fast_dev_run)
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
            or (cut_too and self._last_cut_step == trainer.global_step)
        )

    def _cut(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        *,
        final: bool = False,
        ranked: bool | None = None,
        last: bool = True,
    ) -> None:
        if self._last_cut_step == step and not final:
            return
        # ModelCheckpoint's name and top-k decision; a cut that enters no top k (and no save_last) is not taken.
        candidates, rank = monitor_candidates(trainer), not final if ranked is None else ranked
        take, entry = self.selection.prepare(trainer, candidates, ranked=rank, last=last)
        if not take and not final:
            return
        self._last_cut_step = step
        self._raise_collectively(trainer, committed_clash(step, self._committed_before, self.dirpath))
        self.requested_step = step
        decision, error, handle = "admit", None, None
        # The checkpoint that ends training is copied at the cut: no training follows to overlap with, and
        # validation or epoch-end bookkeeping after it must not reach it (it can never be refused and retaken).
        # So is a cut after which EarlyStopping may stop training (validation or the epoch end follows): a retake
        # after that stop would not be this step's state.
        defer = self.defer and not final and not training_ends_here(trainer) and not stop_may_follow(trainer)
        # A retake of a refused save due on dirpath is due there too (two tiers; schedule.py).
        durable = self.tiers is not None and (
            self.tiers.durable_due(step, ranked=ranked, final=final) or self._schedule.retake_durable
        )
        try:
            # The file is named by the rendered template inside the step's folder (lightning/naming.py).
            key, dcp = checkpoint_key(entry.filename, self.FILE_EXTENSION), self._sharded is not None
            local = self.store if self.tiers is None else self.tiers.local_store  # where the engine writes
            entry.planned = planned_path(local, step, key, sharded=dcp)
            self.selection.cutting = entry  # its own state is ModelCheckpoint's once it is saved (selection_state)
            try:
                checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=self.save_weights_only)
            finally:
                self.selection.cutting = None
            objects: dict[str, bytes] = {}
            if self._sharded is not None:  # the strategy's DCP layout and meta.pt; the sharded capturer's own proof
                checkpoint, objects, defer = self._sharded.layout.prepare(step, checkpoint, [pl_module], defer)
                proof = None
            else:
                proof = lightning_proof(trainer, pl_module, self) if defer else (FINAL_PROOF if self.defer else None)
            if self.checkpointer is not None:
                handle = self.checkpointer.save(
                    step,
                    checkpoint,
                    modules=[pl_module],
                    optimizers=trainer.optimizers,
                    proof=proof,
                    defer=defer,
                    objects=objects,
                    cut={"epoch": trainer.current_epoch, "global_step": step, "world_size": trainer.world_size},
                    admission="wait" if final else None,
                    extra={**self.selection.extra(entry), **cut_metrics(self, candidates)},
                    object_keys={CHECKPOINT_NAME: key} if key and not dcp else None,
                    **({} if self.tiers is None else {"durable": durable}),  # promoted by the engine's target
                )
                decision = handle.decision.decision
                if self.verbose:
                    handle.committed.add_done_callback(log_commit)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
        # Every rank records rank 0's decision, and a capture failure on one rank fails all of them instead of
        # leaving the others waiting in the next collective.
        decision = agree_on(trainer, error, f"capturing the checkpoint for step {step}", decision)
        if decision in ("skip", "coalesce"):
            self.skipped += 1
        else:
            self.selection.admitted(entry, handle)
            self._model_checkpoint_step = step if ranked or not final else self._model_checkpoint_step
        self._schedule.recorded(step, decision, handle, deferred=defer, durable=durable)

    def _raise_collectively(self, trainer: pl.Trainer, local: BaseException | None = None) -> None:
        # A background error from an earlier save is raised here, at a collective point, on every rank.
        if local is None and self.checkpointer is not None:
            local = self.checkpointer.take_pending_error()
        agree_on(trainer, local, "a checkpoint save")

    def _close(self, trainer: pl.Trainer, *, raise_errors: bool) -> None:
        # Called from on_train_end and teardown; collective in DDP, so every rank runs it exactly once per fit.
        if self._fit_closed:
            return
        self._fit_closed = True
        error: BaseException | None = None
        if self.checkpointer is not None and not self.checkpointer.closed:
            try:
                self.checkpointer.close()  # the final commit, then its promotion and replicas; errors raised
            except Exception as exc:  # noqa: BLE001 - raised below, after every rank took part in the collective
                error = exc
            self._sync_progress()
            self._poll(trainer)
            finish_exports(self)  # export=: the final export, waited for (commits.py)
            error = error or self.checkpointer.take_pending_error()  # a commit hook or an export of the last ones
        try:
            progress = (self.committed_step, self.selection.summary())
            self.committed_step, summary = agree_on(trainer, error, "draining checkpoint saves", progress)
            self.selection.apply(summary)
            log_final(trainer, self.committed_step, to_loggers=self.log_metrics)  # the last word (progress.py)
        except Exception:
            if raise_errors:
                raise

    # -- progress ----------------------------------------------------------------------------------------
    def _poll(self, trainer: pl.Trainer) -> None:
        # Commits are taken in on the training thread: best-k, best_model_path, loggers' after_save_checkpoint.
        if self.checkpointer is not None:
            self.selection.poll(trainer, self.store, self._path_of)
            deliver(self, trainer)  # on_commit and on_checkpoint_committed, after best-k is known (commits.py)
