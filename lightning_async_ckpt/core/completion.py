"""How a save ends: the upload thread's job, the commit bookkeeping, failures turned into outcomes, and the
queue of background errors raised on the training thread (each once, oldest first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from lightning_async_ckpt.core.capture import Category
from lightning_async_ckpt.core.capturer import CutCapture
from lightning_async_ckpt.core.handle import SaveHandle
from lightning_async_ckpt.core.persist import AbandonedError
from lightning_async_ckpt.core.staging import BufferPool, StagingJob
from lightning_async_ckpt.core.stream_persister import PersistWork
from lightning_async_ckpt.core.telemetry import EventLog, Outcome, SaveRecord
from lightning_async_ckpt.errors import CheckpointError, TornSnapshotError

__all__ = ["Completion"]

_log = logging.getLogger("lightning_async_ckpt")


class Completion:
    """Mixin of :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`: everything after the cut.

    Runs on the upload thread except the error queue's readers (training thread); shared state is guarded by
    ``_lock``.
    """

    store: Any
    options: Any
    persister: Any
    pool: BufferPool
    events: EventLog
    records: deque[SaveRecord]
    committed_step: int | None
    last_committed: SaveRecord | None
    torn_step: int | None
    abandoning: threading.Event
    _errors: deque[BaseException]
    _lock: threading.Lock
    _demoted: set[Category]

    def _persist(
        self,
        handle: SaveHandle,
        capture: CutCapture,
        cut: dict[str, Any],
        extra: dict[str, Any],
        object_keys: dict[str, str] | None = None,
        objects: dict[str, bytes] | None = None,
    ) -> None:
        record, job, buffers = handle.record, capture.job, capture.buffers

        def release() -> None:
            # Before the save's futures resolve: a caller that saw it end may take the next cut at once and must
            # find these buffers free. An abandoned save's buffers may still be read by the I/O thread: kept.
            record.peak_retained_bytes = self.pool.peak_bytes
            if not self.abandoning.is_set():
                self.pool.release(buffers)

        try:
            self._wait_staged(job)
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
            self._fail(handle, exc)
            return
        release()
        record.outcome = Outcome.COMMITTED
        with self._lock:
            if self.committed_step is None or handle.step > self.committed_step:
                self.committed_step = handle.step
        record.committed_step = self.committed_step
        record.cut_to_committed_s = time.time() - record.t_request
        self.last_committed = record
        try:
            self.events.emit("committed", step=handle.step, committed_step=self.committed_step)
            self._finish_record(record)
        finally:
            # Whatever telemetry does, the committed future resolves: drain and close() must never hang on it.
            handle.committed.set_result(manifest)
        if self.options.keep_last is not None and self.persister.coordinator:
            self._retain()

    def _wait_staged(self, job: StagingJob) -> None:
        job.done.wait()

    def _uploaded(self, handle: SaveHandle, value: Any, nbytes: int) -> None:
        if not handle.uploaded.done():
            handle.uploaded.set_result(value)
        self.events.emit("uploaded", step=handle.step, bytes=nbytes, upload_s=handle.record.upload_s)

    def _fail(self, handle: SaveHandle, exc: BaseException) -> None:
        record = handle.record
        # A guard refusal: this process's own, or one that failed a collective save on some rank (``.torn``).
        torn = isinstance(exc, TornSnapshotError) or getattr(exc, "torn", False) is True
        if torn:
            record.outcome = Outcome.TORN
            if handle._job is not None:
                self._demoted |= handle._job.torn_categories
            self.torn_step = handle.step
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
        record.committed_step = self.committed_step
        try:
            self.events.emit("failed", step=handle.step, outcome=record.outcome, error=record.error)
            # The error is pending (and the record final) before the futures resolve, so a caller that saw the
            # future fail gets the error at its very next save/wait/poll/drain, never one call late.
            if record.outcome is Outcome.FAILED:
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

    # -- the error queue (training thread) ----------------------------------------------------------------
    def raise_pending(self) -> None:
        """Re-raise the oldest pending background error (each error is raised exactly once, oldest first)."""
        if self._errors:
            error = self.take_pending_error()
            if error is not None:
                raise error

    def report_error(self, error: BaseException) -> None:
        """Queue ``error`` from work that follows a commit (a promotion to another tier, from any thread): raised
        once on the training thread like a failed save, or logged with ``on_error="warn"``."""
        if self.options.on_error == "raise":
            with self._lock:
                self._errors.append(error)
        else:
            _log.warning("%s (on_error='warn': training continues)", error)

    def take_pending_error(self) -> BaseException | None:
        """Remove and return the oldest pending background error, if any (for callers that raise collectively).

        Later errors stay pending for the next call; none is dropped.
        """
        with self._lock:
            return self._errors.popleft() if self._errors else None

    @property
    def pending_errors(self) -> int:
        """How many background errors wait to be raised."""
        return len(self._errors)
