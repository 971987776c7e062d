"""The asynchronous checkpoint engine: admission, capture at the cut, fenced staging, upload, commit.

Pipeline of one request::

    save(step, state) -> admission -> capture plan + copy at the cut -> staging thread (fenced) -> staged
        -> upload thread: serialize + stream via the store (checksums) -> uploaded -> manifest last -> committed
        -> retention (only after a newer commit)
"""

from __future__ import annotations

import atexit
import errno
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from lightning_async_ckpt.core.admission import POLICIES, AdmissionDecision
from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence, prove_deferral
from lightning_async_ckpt.core.handle import DrainOnExit, SaveHandle, _Worker
from lightning_async_ckpt.core.options import CheckpointOptions, Serializer, TorchSaveSerializer
from lightning_async_ckpt.core.staging import BufferPool, StagingJob, resolve_budget
from lightning_async_ckpt.core.telemetry import EventLog, SaveRecord
from lightning_async_ckpt.errors import (
    AdmissionError,
    CheckpointError,
    ConfigError,
    GenerationExistsError,
    ManifestError,
    StorageError,
    TornSnapshotError,
)
from lightning_async_ckpt.storage.store import CheckpointStore, GenerationWriter

__all__ = ["AsyncCheckpointer", "CheckpointOptions", "SaveHandle", "Serializer", "TorchSaveSerializer"]

_log = logging.getLogger("lightning_async_ckpt")
_THREAD_PREFIX = "lightning_async_ckpt"


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, GenerationExistsError | ManifestError | ConfigError | TornSnapshotError):
        return False
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return False
        cause = cause.__cause__
    return isinstance(exc, OSError | StorageError | TimeoutError | ConnectionError)


class AsyncCheckpointer(DrainOnExit):
    """Framework-free asynchronous checkpointing into a :class:`CheckpointStore`.

    Thread-safety: ``save``, ``wait``, ``poll``, ``drain`` and ``close`` are called from one training thread; the
    engine's own work runs on two named threads (``lightning_async_ckpt-stage`` and ``-upload``), created lazily.
    Background errors are re-raised once, on the training thread, at the next ``save``/``wait``/``poll``/``drain``.

    Args:
        store: Where generations go (or a URL to open one).
        options: Engine settings; keyword arguments override its fields.
        **overrides: Any :class:`CheckpointOptions` field.

    Example::

        with AsyncCheckpointer(CheckpointStore("/tmp/ckpt"), keep_last=2) as ckpt:
            ckpt.attach(model, optimizer)
            for step in range(100):
                train_step()
                if step % 10 == 0:
                    ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
    """

    def __init__(
        self, store: CheckpointStore | str, options: CheckpointOptions | None = None, **overrides: Any
    ) -> None:
        if isinstance(store, str):
            store = CheckpointStore(store)
        if not isinstance(store, CheckpointStore):
            raise ConfigError(f"store must be a CheckpointStore or a URL string, got {type(store).__name__}")
        if options is not None and not isinstance(options, CheckpointOptions):
            raise ConfigError(f"options must be a CheckpointOptions or None, got {type(options).__name__}")
        if options is None:
            options = CheckpointOptions(**overrides)
        elif overrides:
            options = CheckpointOptions(**{**options.__dict__, **overrides})
        self.store = store
        self.options = options
        self.serializer: Serializer = options.serializer or TorchSaveSerializer()
        self.pool = BufferPool(resolve_budget(options.host_memory_budget, options.reserved_host_bytes))
        self.events = EventLog(options.event_log)
        self.records: deque[SaveRecord] = deque(maxlen=10_000)
        self._stage = _Worker(f"{_THREAD_PREFIX}-stage")
        self._upload = _Worker(f"{_THREAD_PREFIX}-upload", nice=options.upload_nice)
        self._inflight: deque[SaveHandle] = deque()
        self._errors: deque[BaseException] = deque()
        self._lock = threading.Lock()
        self._demoted: set[Category] = set()
        self._fences: set[Fence] = set()
        self._hooks: list[Any] = []
        self._abandon = threading.Event()
        self._closed = False
        self.committed_step: int | None = None
        self.last_committed: SaveRecord | None = None
        self.requested_step: int | None = None
        self.pending_coalesce: int | None = None
        self.skipped = 0
        self._side_streams: dict[torch.device, Any] = {}
        self._atexit = _make_atexit(weakref.ref(self))
        atexit.register(self._atexit)

    # -- saving ------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        modules: Sequence[torch.nn.Module] = (),
        optimizers: Sequence[Any] = (),
        proof: DeferralProof | None = None,
        defer: bool = True,
        cut: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        admission: str | None = None,
    ) -> SaveHandle:
        """Request a checkpoint of ``state`` at the cut ``step``.

        The call returns once the cut is captured: Python objects deep-copied, copy-at-cut tensors copied,
        deferred tensors fingerprinted. Deferred tensors are staged in the background; the caller must call
        :meth:`wait` at their fences (``attach`` does that in plain loops).

        Args:
            step: The cut's global step (one generation per step).
            state: Nested dicts/lists/tuples of tensors and Python objects; tensors may alias live memory.
            modules: Modules whose parameters/buffers appear in ``state`` (for classification).
            optimizers: Optimizers whose state appears in ``state``.
            proof: Deferral proof; default: proven from ``modules``/``optimizers`` and the fences this checkpointer
                knows the caller calls (see :meth:`attach`).
            defer: ``False`` copies everything at the cut.
            cut: Extra cut metadata for the manifest (epoch, ...).
            extra: Free-form JSON metadata for the manifest.
            admission: Policy for this request only (e.g. ``"wait"`` for a final checkpoint that must not be
                skipped); default: the configured one.

        Returns:
            The save's handle; for a skipped or coalesced request its futures are cancelled.

        Raises:
            AdmissionError: ``admission="abort"`` and the outstanding limit is reached.
            CheckpointError: A previous save failed in the background (raised once).
        """
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed; create a new one to keep saving")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        self.raise_pending()
        t0 = time.perf_counter()
        record = SaveRecord(requested_step=step)
        if admission is not None and admission not in POLICIES:
            raise ConfigError(f"admission must be one of {', '.join(POLICIES)} or None, got {admission!r}")
        decision = self._admit(step, admission or self.options.admission)
        record.decision, record.backlog, record.admission_wait_s = (
            decision.decision,
            decision.backlog,
            decision.waited_s,
        )
        self.requested_step = step
        self.events.emit(
            "request",
            step=step,
            decision=decision.decision,
            backlog=decision.backlog,
            committed_step=self.committed_step,
            arrived=record.t_request,
            waited_s=decision.waited_s,
        )
        handle = SaveHandle(step=step, record=record, decision=decision)
        if not decision.admitted:
            record.outcome = "coalesced" if decision.decision == "coalesce" else "skipped"
            record.committed_step = self.committed_step
            self.skipped += 1
            for fut in (handle.staged, handle.uploaded, handle.committed):
                fut.cancel()
            self._finish_record(record)
            return handle
        if proof is None and defer:
            proof = prove_deferral(
                modules,
                optimizers,
                has_optimizer_step_fence=Fence.OPTIMIZER_STEP in self._fences,
                has_batch_start_fence=Fence.BATCH_START in self._fences,
                ignore_hooks=_is_own_hook,
            )
        plan = CapturePlan.build(
            state, modules=modules, optimizers=optimizers, proof=proof if defer else None, demoted=self._demoted
        )
        self.pool.check(plan.total_bytes)
        buffers = self.pool.acquire(plan.slots)
        job = StagingJob(plan.slots, buffers, guard=self.options.guard)
        try:
            job.copy_at_cut(self._streams_for(plan))
        except BaseException:
            self.pool.release(buffers)
            raise
        handle.plan, handle._job = plan, job
        record.sync_bytes = plan.total_bytes - job.deferred_bytes
        record.deferred_bytes = job.deferred_bytes
        record.blocked_s = time.perf_counter() - t0
        record.mark("cut", record.t_request)
        cut_meta = {"step": step, "requested_at": record.t_request, **(cut or {})}
        with self._lock:
            self._inflight.append(handle)
        self._stage.submit(job.run)
        self._upload.submit(lambda: self._persist(handle, job, plan, buffers, cut_meta, extra or {}))
        return handle

    def _admit(self, step: int, policy: str) -> AdmissionDecision:
        backlog = self.outstanding
        if backlog < self.options.max_outstanding:
            if self.pending_coalesce is not None:
                self.pending_coalesce = None
            return AdmissionDecision(step, "admit", backlog, self.committed_step)
        if policy == "abort":
            self.events.emit(
                "request", step=step, decision="abort", backlog=backlog, committed_step=self.committed_step
            )
            raise AdmissionError(
                f"checkpoint for step {step} requested while {backlog} save(s) are outstanding "
                f"(max_outstanding={self.options.max_outstanding}, admission='abort'); storage is not keeping up: "
                "checkpoint less often, raise max_outstanding, or choose admission='wait', 'skip' or 'coalesce'"
            )
        if policy == "skip":
            return AdmissionDecision(step, "skip", backlog, self.committed_step)
        if policy == "coalesce":
            self.pending_coalesce = step
            return AdmissionDecision(step, "coalesce", backlog, self.committed_step)
        t0 = time.perf_counter()
        while self.outstanding >= self.options.max_outstanding:
            with self._lock:
                oldest = self._inflight[0] if self._inflight else None
            if oldest is not None:
                try:
                    oldest.committed.result()
                except Exception:  # noqa: BLE001 - its error is delivered through raise_pending
                    pass
                self._reap()
        waited = time.perf_counter() - t0
        self.raise_pending()
        return AdmissionDecision(step, "wait", backlog, self.committed_step, waited)

    @property
    def outstanding(self) -> int:
        """Saves admitted and not yet ended."""
        self._reap()
        return len(self._inflight)

    @property
    def coalesce_due(self) -> bool:
        """True when a coalesced request is waiting and the backlog has drained: take a fresh cut now."""
        return self.pending_coalesce is not None and self.outstanding < self.options.max_outstanding

    def _reap(self) -> None:
        with self._lock:
            while self._inflight and self._inflight[0].done:
                self._inflight.popleft()

    def _streams_for(self, plan: CapturePlan) -> dict[torch.device, Any]:
        for slot in plan.slots:
            if slot.device.type == "cuda" and slot.device not in self._side_streams:
                self._side_streams[slot.device] = torch.cuda.Stream(slot.device)
        return self._side_streams

    # -- background --------------------------------------------------------------------------------------
    def _persist(
        self,
        handle: SaveHandle,
        job: StagingJob,
        plan: CapturePlan,
        buffers: list[torch.Tensor],
        cut: dict[str, Any],
        extra: dict[str, Any],
    ) -> None:
        record = handle.record

        def release() -> None:
            # Before the save's futures resolve: a caller that saw it end (result(), admission wait) may take
            # the next cut at once, and must find these buffers free, not grow the pool or hit the budget.
            record.peak_retained_bytes = self.pool.peak_bytes
            self.pool.release(buffers)

        try:
            self._wait_staged(job)
            record.staging_s = job.staging_s
            record.mark("staging", job.stage_started_wall, job.stage_started_wall + job.staging_s)
            if job.error is not None:
                raise job.error
            handle.staged.set_result(handle.step)
            self.events.emit("staged", step=handle.step, staging_s=job.staging_s)
            state = plan.materialize(buffers)
            manifest = self._write_with_retries(handle, state, plan, cut, extra)
        except BaseException as exc:  # noqa: BLE001 - delivered through the futures and raise_pending
            release()
            self._fail(handle, exc)
            return
        release()
        record.outcome = "committed"
        with self._lock:
            if self.committed_step is None or manifest.step > self.committed_step:
                self.committed_step = manifest.step
        record.committed_step = self.committed_step
        record.cut_to_committed_s = time.time() - record.t_request
        self.last_committed = record
        try:
            self.events.emit("committed", step=handle.step, committed_step=self.committed_step)
            self._finish_record(record)
        finally:
            # Whatever telemetry does, the committed future resolves: drain and close() must never hang on it.
            handle.committed.set_result(manifest)
        if self.options.keep_last is not None:
            self._retain()

    def _wait_staged(self, job: StagingJob) -> None:
        job.done.wait()

    def _write_with_retries(
        self, handle: SaveHandle, state: Any, plan: CapturePlan, cut: dict[str, Any], extra: dict[str, Any]
    ) -> Any:
        record = handle.record
        attempt = 0
        while True:
            if self._abandon.is_set():
                raise CheckpointError(f"save of step {handle.step} abandoned at close; no manifest was written")
            writer: GenerationWriter | None = None
            try:
                t_up = time.time()
                writer = self.store.begin(handle.step)
                self.serializer.write(state, writer)
                record.upload_s = time.time() - t_up
                record.bytes = sum(o.size for o in writer.objects)
                record.throughput_bps = record.bytes / record.upload_s if record.upload_s > 0 else None
                record.mark("upload", t_up)
                if not handle.uploaded.done():
                    handle.uploaded.set_result(record.bytes)
                self.events.emit("uploaded", step=handle.step, bytes=record.bytes, upload_s=record.upload_s)
                if self._abandon.is_set():
                    writer.abort()
                    raise CheckpointError(f"save of step {handle.step} abandoned at close; no manifest was written")
                t_commit = time.time()
                timings = {"blocked_s": record.blocked_s, "staging_s": record.staging_s, "upload_s": record.upload_s}
                manifest = writer.commit(cut=cut, plan=plan.summary(), timings=timings, extra=extra)
                record.commit_s = time.time() - t_commit
                record.mark("commit", t_commit)
                return manifest
            except BaseException as exc:
                if writer is not None:
                    writer.abort()
                if attempt > 0 and isinstance(exc, GenerationExistsError):
                    # Attempt 0 found no manifest, so one found now is an earlier attempt's PUT that landed
                    # although its acknowledgement was lost: the generation is committed, not failed.
                    landed = self._own_commit(handle.step)
                    if landed is not None:
                        return landed
                if attempt >= self.options.retries or not _is_transient(exc):
                    raise
                delay = self.options.retry_backoff_s * (2**attempt)
                attempt += 1
                _log.warning("save of step %d failed (%s); retry %d in %.2fs", handle.step, exc, attempt, delay)
                self.events.emit("retry", step=handle.step, attempt=attempt, error=str(exc))
                if self._abandon.wait(delay):
                    raise CheckpointError(f"save of step {handle.step} abandoned at close") from exc

    def _own_commit(self, step: int) -> Any:
        try:
            manifest = self.store.manifest(step)
        except ManifestError:
            return None
        if manifest.run_id != self.store.run_id or self.store.check_sizes(manifest):
            return None
        return manifest

    def _fail(self, handle: SaveHandle, exc: BaseException) -> None:
        record = handle.record
        torn = isinstance(exc, TornSnapshotError)
        if torn:
            record.outcome = "torn"
            if handle._job is not None:
                self._demoted |= handle._job.torn_categories
            _log.warning("checkpoint for step %d refused: %s", handle.step, exc)
            error = exc
        else:
            record.outcome = "abandoned" if self._abandon.is_set() else "failed"
            error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"checkpoint for step {handle.step} failed: {type(exc).__name__}: {exc}")
            )
            if error is not exc:
                error.__cause__ = exc
        record.error = f"{type(exc).__name__}: {exc}"
        record.committed_step = self.committed_step
        try:
            self.events.emit("failed", step=handle.step, outcome=record.outcome, error=record.error)
            # The error is pending (and the record final) before the futures resolve, so a caller that saw the
            # future fail gets the error at its very next save/wait/poll/drain, never one call late.
            if not torn and record.outcome == "failed":
                if self.options.on_error == "raise":
                    with self._lock:
                        self._errors.append(error)
                else:
                    _log.warning(
                        "%s (on_error='warn': training continues; last committed step %s)", error, self.committed_step
                    )
            self._finish_record(record)
        finally:
            for fut in (handle.staged, handle.uploaded, handle.committed):
                if not fut.done():
                    fut.set_exception(error)

    def _retain(self) -> None:
        try:
            removed = self.store.gc(self.options.keep_last)
        except Exception:  # noqa: BLE001 - retention never fails a committed save
            _log.warning("retention failed", exc_info=True)
            return
        if removed:
            self.events.emit("gc", removed=removed)

    def _finish_record(self, record: SaveRecord) -> None:
        self.records.append(record)
        self.events.emit("save", **record.as_dict())
        _log.info(
            "checkpoint requested step %s -> %s (committed step %s, blocked %.4fs)",
            record.requested_step,
            record.outcome,
            record.committed_step,
            record.blocked_s,
        )

    # -- training-thread calls ---------------------------------------------------------------------------
    def wait(self, fence: Fence, *, raise_errors: bool = True) -> float:
        """Block at ``fence`` until every outstanding save's storages fenced there are staged.

        Cheap when nothing is outstanding; call it right before the first mutation of the fenced categories.

        Args:
            fence: The fence being passed.
            raise_errors: Re-raise a pending background error here (multi-process callers raise them only at
                collective points instead).

        Returns:
            Seconds blocked.
        """
        if raise_errors:
            self.raise_pending()
        if not self._inflight:
            return 0.0
        waited = 0.0
        with self._lock:
            handles = list(self._inflight)
        for handle in handles:
            w = handle.wait(fence)
            if w:
                handle.record.fence_wait_s[fence.value] = handle.record.fence_wait_s.get(fence.value, 0.0) + w
            waited += w
        return waited

    def raise_pending(self) -> None:
        """Re-raise the oldest background error once (then it is cleared)."""
        if self._errors:
            error = self.take_pending_error()
            if error is not None:
                raise error

    def take_pending_error(self) -> BaseException | None:
        """Remove and return the pending background error, if any (for callers that raise it collectively)."""
        with self._lock:
            error = self._errors.popleft() if self._errors else None
            self._errors.clear()
        return error

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def poll(self) -> None:
        """Raise a pending background error, if any."""
        self._reap()
        self.raise_pending()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every outstanding save ended; re-raise a background error.

        Returns:
            True if everything ended within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            handles = list(self._inflight)
        finished = True
        for handle in handles:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.committed.result(remaining)
            except FutureTimeout:
                finished = False
                break
            except Exception:  # noqa: BLE001 - delivered through raise_pending
                pass
        self._reap()
        self.raise_pending()
        return finished

    # -- plain PyTorch loops -----------------------------------------------------------------------------
    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
    ) -> None:
        """Install the fences for a plain loop: an optimizer step pre-hook and a forward pre-hook.

        Afterwards ``save(..., modules=[model], optimizers=[optimizer])`` defers what the proof allows, without
        other code changes. :meth:`detach` removes the hooks.
        """
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}")
            self._hooks.append(opt.register_step_pre_hook(_fence_hook(self, Fence.OPTIMIZER_STEP)))
        self._hooks.append(model.register_forward_pre_hook(_fence_hook(self, Fence.BATCH_START)))
        self._fences |= {Fence.OPTIMIZER_STEP, Fence.BATCH_START}

    def detach(self) -> None:
        """Remove the hooks installed by :meth:`attach` (after waiting at every fence)."""
        self.wait(Fence.OPTIMIZER_STEP)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._fences.clear()

    def declare_fences(self, fences: Iterable[Fence]) -> None:
        """Tell the engine which fences the caller calls (integrations that install their own hooks)."""
        self._fences = set(fences)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def close(self, timeout: float | None = None, *, abandon: bool = False) -> None:
        """Drain outstanding saves (or abandon them, leaving no manifest), stop the threads; idempotent.

        Args:
            timeout: Bound on the drain; on expiry the rest is abandoned (no manifest is written for it).
            abandon: Do not wait for uploads: uncommitted saves are aborted.

        Raises:
            CheckpointError: A background error that was not raised yet.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if abandon:
            self._abandon.set()
            # An upload stuck in storage must not hang close(abandon=True): bound every wait.
            timeout = self.options.drain_timeout_s if timeout is None else timeout
        # One deadline for the whole close: the drain and the thread joins share it.
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        error: BaseException | None = None
        try:
            finished = self.drain(remaining())
        except CheckpointError as exc:
            error = exc
            finished = self.drain_quietly(remaining())
        if not finished:
            self._abandon.set()
            _log.warning("close: saves still outstanding after %ss were abandoned; no manifest for them", timeout)
        # Drained threads are idle and exit at once; after a timed-out drain only what is left of the bound is given.
        join = None if finished else remaining()
        stopped = self._stage.stop(join) & self._upload.stop(join)
        if not stopped:
            _log.warning("close: a checkpoint thread is still blocked in storage; it was left to the interpreter")
        self.events.close()
        self.pool.clear()
        if error is not None:
            raise error

    def drain_quietly(self, timeout: float | None) -> bool:
        """Like :meth:`drain` but never raises; returns whether everything ended."""
        try:
            return self.drain(timeout)
        except Exception:  # noqa: BLE001 - used on shutdown paths where the error was already reported
            return not self._inflight

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_inflight", None):
            _log.warning("AsyncCheckpointer garbage-collected with saves outstanding; call close()")


def _fence_hook(engine: AsyncCheckpointer, fence: Fence) -> Callable[..., None]:
    def hook(*_: Any) -> None:  # returns None: a forward pre-hook's return value would replace the input
        engine.wait(fence)

    hook._lightning_async_ckpt = True  # type: ignore[attr-defined]
    return hook


def _is_own_hook(hook: Any) -> bool:
    return bool(getattr(hook, "_lightning_async_ckpt", False))


def _make_atexit(ref: weakref.ReferenceType) -> Callable[[], None]:
    def _drain_at_exit() -> None:
        engine = ref()
        if engine is None or engine._closed:
            return
        pending = engine.outstanding
        t0 = time.monotonic()
        done = engine.drain_quietly(engine.options.drain_timeout_s)
        _log.warning(
            "interpreter exit: drained %d outstanding checkpoint save(s) in %.2fs (%s); last committed step %s",
            pending,
            time.monotonic() - t0,
            "complete" if done else "timed out, rest abandoned",
            engine.committed_step,
        )
        engine._closed = True

    return _drain_at_exit
