"""How a save ends: the upload thread's job, the commit bookkeeping, failures turned into outcomes, and the
queue of background errors raised on the training thread (each once, oldest first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lightning_async_ckpt.core.admission import AdmissionResult
from lightning_async_ckpt.core.capture import Category
from lightning_async_ckpt.core.capturer import CutCapture
from lightning_async_ckpt.core.handle import SaveHandle
from lightning_async_ckpt.core.interfaces import CommitTarget
from lightning_async_ckpt.core.persist import AbandonedError
from lightning_async_ckpt.core.staging import BufferPool
from lightning_async_ckpt.core.stream_persister import PersistWork
from lightning_async_ckpt.core.telemetry import EventLog, Outcome, SaveRecord
from lightning_async_ckpt.errors import CheckpointError, TornSnapshotError

__all__ = ["Completion", "Progress", "ProgressView"]

_log = logging.getLogger("lightning_async_ckpt")


class Progress:
    """What the threads share about ended saves: the committed step, the records, the guard's refusals, the errors.

    Written by the upload thread (and by work that follows a commit, e.g. a promotion), read by the training
    thread; guarded by :attr:`lock`. Background errors are queued here and raised on the training thread, each
    once, oldest first.

    Args:
        on_error: ``"raise"``: queue failures for the training thread; ``"warn"``: log them and go on.
    """

    def __init__(self, on_error: str = "raise") -> None:
        self.on_error = on_error
        self.lock = threading.Lock()
        self.records: deque[SaveRecord] = deque(maxlen=10_000)
        self.committed_step: int | None = None
        self.last_committed: SaveRecord | None = None
        self.torn_step: int | None = None  # the newest admitted save the guard refused (a retake is due)
        self.demoted: set[Category] = set()  # categories copied at the cut since a refusal
        self.errors: deque[BaseException] = deque()

    def report(self, error: BaseException, *, context: str = "") -> None:
        """Queue ``error`` for the training thread (``on_error="raise"``), or log it (``"warn"``)."""
        if self.on_error == "raise":
            with self.lock:
                self.errors.append(error)
        else:
            _log.warning("%s (on_error='warn': training continues%s)", error, context)

    def take(self) -> BaseException | None:
        """Remove and return the oldest queued error, if any."""
        with self.lock:
            return self.errors.popleft() if self.errors else None

    def raise_pending(self) -> None:
        """Raise the oldest queued error (each exactly once, oldest first)."""
        if self.errors:
            error = self.take()
            if error is not None:
                raise error


class ProgressView:
    """The training thread's view of an engine's :class:`Progress` (the engine's ``progress`` attribute)."""

    progress: Progress

    @property
    def committed_step(self) -> int | None:
        """The newest step this checkpointer committed (or a resumed fit restored)."""
        return self.progress.committed_step

    @committed_step.setter
    def committed_step(self, step: int | None) -> None:
        self.progress.committed_step = step

    @property
    def last_committed(self) -> SaveRecord | None:
        """The record of the newest commit."""
        return self.progress.last_committed

    @property
    def torn_step(self) -> int | None:
        """The newest admitted save the guard refused (cleared by the next admitted save)."""
        return self.progress.torn_step

    @property
    def records(self) -> deque[SaveRecord]:
        """One record per request, oldest first (bounded)."""
        return self.progress.records

    @property
    def pending_errors(self) -> int:
        """How many background errors wait to be raised."""
        return len(self.progress.errors)

    def raise_pending(self) -> None:
        """Re-raise the oldest pending background error (each error is raised exactly once, oldest first)."""
        self.progress.raise_pending()

    def take_pending_error(self) -> BaseException | None:
        """Remove and return the oldest pending background error, if any (for callers that raise collectively)."""
        return self.progress.take()

    def report_error(self, error: BaseException) -> None:
        """Queue ``error`` from work that follows a commit (a promotion to another tier, from any thread): raised
        once on the training thread like a failed save, or logged with ``on_error="warn"``."""
        self.progress.report(error)


class Completion:
    """Everything after the cut, on the engine's upload thread: persist, commit bookkeeping, outcomes, the hand-over
    to the commit target.

    Owned by :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`; :meth:`run` is the upload thread's job
    for one admitted save.

    Args:
        persister: Writes a staged save (:class:`~lightning_async_ckpt.core.interfaces.Persister`).
        pool: The staging pool the save's buffers go back to.
        events: The event log.
        progress: Where outcomes, records and errors go.
        abandoning: Set when the engine abandons its saves.
        target: Told of each commit this process hands on, before ``committed`` resolves
            (:class:`~lightning_async_ckpt.core.interfaces.CommitTarget`: retention, promotion, replicas), else
            ``None``.
        on_commit: Told of each manifest this process committed, on the upload thread, before ``committed``
            resolves (the engine's :class:`~lightning_async_ckpt.core.commit_hooks.CommitHooks`).
    """

    def __init__(
        self,
        *,
        persister: Any,
        pool: BufferPool,
        events: EventLog,
        progress: Progress,
        abandoning: threading.Event,
        target: CommitTarget | None,
        on_commit: Callable[[Any], None] | None = None,
    ) -> None:
        self.persister = persister
        self.pool = pool
        self.events = events
        self.progress = progress
        self.abandoning = abandoning
        self.target = target
        self.on_commit = on_commit if persister.coordinator else None

    def run(
        self,
        handle: SaveHandle,
        capture: CutCapture,
        cut: dict[str, Any],
        extra: dict[str, Any],
        object_keys: dict[str, str] | None = None,
        objects: dict[str, bytes] | None = None,
        durable: bool | None = None,
    ) -> None:
        record, job, buffers = handle.record, capture.job, capture.buffers

        def release() -> None:
            # Before the save's futures resolve: a caller that saw it end may take the next cut at once and must
            # find these buffers free. An abandoned save's buffers may still be read by the I/O thread: kept.
            record.peak_retained_bytes = self.pool.peak_bytes
            if not self.abandoning.is_set():
                self.pool.release(buffers)

        try:
            job.done.wait()
            record.staging_s = job.staging_s
            record.mark("staging", job.stage_started_wall, job.stage_started_wall + job.staging_s)
            if job.error is not None and not self.persister.collective:
                raise job.error
            if job.error is None:
                if not handle.staged.done():
                    handle.staged.set_result(handle.step)
                self.events.emit("staged", step=handle.step, staging_s=job.staging_s)
            work = PersistWork(
                step=handle.step,
                state=capture.staged_state() if job.error is None else {},
                job=job,
                buffers=buffers,
                record=record,
                cut=cut,
                plan=capture.plan.summary(),
                extra=extra,
                object_keys=object_keys or {},
                objects=objects or {},
                abandon=self.abandoning,
                uploaded=lambda value, nbytes: self._uploaded(handle, value, nbytes),
            )
            manifest = self.persister.persist(work)
        except BaseException as exc:  # noqa: BLE001 - delivered through the futures and raise_pending
            release()
            self.fail(handle, exc)
            return
        release()
        record.outcome = Outcome.COMMITTED
        progress = self.progress
        with progress.lock:
            if progress.committed_step is None or handle.step > progress.committed_step:
                progress.committed_step = handle.step
        record.committed_step = progress.committed_step
        record.cut_to_committed_s = time.time() - record.t_request
        progress.last_committed = record
        try:
            self.events.emit("committed", step=handle.step, committed_step=progress.committed_step)
            self.finish_record(record)
            if self.on_commit is not None:  # queued before the future resolves: a drain then finds it
                self.on_commit(manifest)
            if self.target is not None:  # handed on before the future resolves: the engine's drain covers it
                self._hand_over(handle.step, durable)
        finally:
            # Whatever telemetry does, the committed future resolves: drain and close() must never hang on it.
            handle.committed.set_result(manifest)

    def _uploaded(self, handle: SaveHandle, value: Any, nbytes: int) -> None:
        if not handle.uploaded.done():
            handle.uploaded.set_result(value)
        self.events.emit("uploaded", step=handle.step, bytes=nbytes, upload_s=handle.record.upload_s)

    def fail(self, handle: SaveHandle, exc: BaseException) -> None:
        """End ``handle`` with ``exc``: a refusal (torn), an abandon or a failure; the futures resolve last."""
        record, progress = handle.record, self.progress
        # A guard refusal: this process's own, or one that failed a collective save on some rank (``.torn``).
        torn = isinstance(exc, TornSnapshotError) or getattr(exc, "torn", False) is True
        if torn:
            record.outcome = Outcome.TORN
            if handle.staging is not None:
                progress.demoted |= handle.staging.torn_categories
            progress.torn_step = handle.step
            _log.warning("checkpoint for step %d refused: %s", handle.step, exc)
            error = exc
        else:
            abandoned = isinstance(exc, AbandonedError) or self.abandoning.is_set()
            record.outcome = Outcome.ABANDONED if abandoned else Outcome.FAILED
            error = (
                exc
                if isinstance(exc, CheckpointError)
                else CheckpointError(f"checkpoint for step {handle.step} failed: {type(exc).__name__}: {exc}")
            )
            if error is not exc:
                error.__cause__ = exc
        record.error = f"{type(exc).__name__}: {exc}"
        record.committed_step = progress.committed_step
        try:
            self.events.emit("failed", step=handle.step, outcome=record.outcome, error=record.error)
            # The error is pending (and the record final) before the futures resolve, so a caller that saw the
            # future fail gets the error at its very next save/wait/poll/drain, never one call late.
            if record.outcome is Outcome.FAILED:
                progress.report(error, context=f"; last committed step {progress.committed_step}")
            self.finish_record(record)
        finally:
            for fut in (handle.staged, handle.uploaded, handle.committed):
                if not fut.done():
                    fut.set_exception(error)

    def _hand_over(self, step: int, durable: bool | None) -> None:
        try:
            self.target.committed(step, durable)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the save committed; what follows it failed
            error = CheckpointError(f"step {step} committed, but handing it on failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self.progress.report(error)

    def requested(self, record: SaveRecord, decision: AdmissionResult) -> None:
        """Emit the ``request`` event of a request admission decided on."""
        self.events.emit(
            "request",
            step=record.requested_step,
            decision=decision.decision,
            backlog=decision.backlog,
            committed_step=self.progress.committed_step,
            arrived=record.t_request,
            waited_s=decision.waited_s,
        )

    def refused(self, record: SaveRecord, decision: AdmissionResult) -> None:
        """End a request admission aborted (``admission="abort"`` at the limit)."""
        record.decision, record.backlog, record.outcome = decision.decision, decision.backlog, Outcome.ABORTED
        record.committed_step = self.progress.committed_step
        self.requested(record, decision)
        self.finish_record(record)

    def finish_record(self, record: SaveRecord) -> None:
        """Record how a request ended (also a skipped or refused one): the records, the event log, one INFO line."""
        self.progress.records.append(record)
        self.events.emit("save", **record.as_dict())
        _log.info(
            "checkpoint requested step %s -> %s (committed step %s, blocked %.4fs)",
            record.requested_step,
            record.outcome,
            record.committed_step,
            record.blocked_s,
        )
