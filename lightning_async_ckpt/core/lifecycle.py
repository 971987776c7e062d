"""The engine's lifecycle: its worker threads, ``close``, the interpreter-exit drain and pool pre-allocation.

No shutdown path may crash the interpreter: a save that outlasts the drain bound is abandoned, its threads stop and
are joined, bounded, before the interpreter finalizes, and the log names the abandoned steps at ERROR.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from lightning_async_ckpt.core.capture import CapturePlan
from lightning_async_ckpt.core.preemption import PreemptionHandler
from lightning_async_ckpt.core.workers import THREAD_PREFIX, Worker, register_at_exit
from lightning_async_ckpt.storage.direct import release_buffers

__all__ = ["ABANDON_JOIN_S", "Lifecycle"]

_log = logging.getLogger("lightning_async_ckpt")
#: How long the staging and upload threads get to stop after their save was abandoned (they stop within a
#: chunk; this bound only matters when storage hangs in a call that cannot be interrupted).
ABANDON_JOIN_S = 1.0


class Lifecycle:
    """Mixin of :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`: threads, close and exit.

    Expects the engine's ``options``, ``pool``, ``events``, ``committed_step``, ``drain``, ``in_flight_steps``,
    ``take_pending_error`` and ``_remove_hooks``.
    """

    options: Any
    pool: Any
    events: Any
    persister: Any
    committed_step: int | None

    def __init__(self, *, upload_nice: int = 0) -> None:
        self.stage_worker = Worker(f"{THREAD_PREFIX}-stage")
        self.upload_worker = Worker(f"{THREAD_PREFIX}-upload", nice=upload_nice)
        self.io_worker = Worker(f"{THREAD_PREFIX}-io", nice=upload_nice)
        #: Set when outstanding saves are abandoned (``close`` timed out, ``abandon=True``, exit drain timed out).
        self.abandoning = threading.Event()
        #: The emergency save's signal handler (none by default; the tiered checkpointers install one): cleared by
        #: the emergency save, removed by :meth:`close`.
        self.preemption = PreemptionHandler(None)
        self._closed = False
        self._exit_hook = register_at_exit(self._at_exit)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the interpreter-exit drain ran)."""
        return self._closed

    def preallocate(self, state: Any, *, modules: Any = (), optimizers: Any = ()) -> Future:
        """Fill the staging pool for ``state`` in the background, before the first cut, off the training thread.

        The first cut's buffers are then reused instead of allocated at the cut (pinned host memory on CUDA costs
        about 0.5 s per GB there). ``state`` is what will be saved (or a :class:`CapturePlan`); only its tensors'
        storage sizes and devices matter, so call it once the optimizer state exists (after the first step).

        Returns:
            A future resolving to the bytes newly reserved; the first ``save`` waits for it if it is still running.
        """
        plan = (
            state
            if isinstance(state, CapturePlan)
            else CapturePlan.build(state, modules=modules, optimizers=optimizers)
        )
        slots = list(plan.slots)
        self.pool.check(plan.total_bytes)
        ticket = self.pool.begin_reserve()
        return self.stage_worker.submit(lambda: self.pool.reserve(slots, ticket=ticket))

    def close(self, timeout: float | None = None, *, abandon: bool = False) -> None:
        """Drain outstanding saves (or abandon them, leaving no manifest), stop the threads; idempotent.

        Args:
            timeout: Bound on the drain; on expiry the rest is abandoned (no manifest is written for it, and the
                log names the abandoned steps at ERROR).
            abandon: Do not wait for uploads: uncommitted saves are aborted.

        Raises:
            CheckpointError: A background error that was not raised yet (later ones are attached as notes).
        """
        if self._closed:
            return
        self._closed = True
        self.preemption.remove()
        self._remove_hooks()  # type: ignore[attr-defined]
        if abandon:
            self.abandoning.set()
            # An upload stuck in storage must not hang close(abandon=True): bound every wait.
            timeout = self.options.drain_timeout_s if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        error: BaseException | None = None
        finished = self.in_flight.drain(remaining())  # type: ignore[attr-defined]  # the saves; the target below
        if not finished:
            self._abandon_outstanding(f"close: not drained within {timeout}s")
        self._stop_workers(None if finished and not self.abandoning.is_set() else remaining())
        try:
            self.target.close(0.0 if self.abandoning.is_set() else remaining())  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - raised below, after the rest closed
            error = exc
        self.deliver_commits()  # type: ignore[attr-defined]  # the last commits' callbacks, on this thread
        self.events.close()
        self.persister.close()
        self.pool.clear()
        release_buffers()  # the aligned write buffers kept between files
        while (later := self.take_pending_error()) is not None:  # type: ignore[attr-defined]
            if error is None:
                error = later
            else:
                error.add_note(f"another checkpoint save also failed: {later}")
        if error is not None:
            raise error

    def _abandon_outstanding(self, why: str) -> None:
        steps = self.in_flight_steps()  # type: ignore[attr-defined]
        newest = self.committed_step  # type: ignore[attr-defined]
        # A save committed whose hand-over to the target (promotion, replicas) still runs has its manifest.
        handing = [s for s in steps if newest is not None and s <= newest]
        lost = [s for s in steps if s not in handing]
        self.abandoning.set()
        said = []
        if lost or not handing:
            said.append(
                f"checkpoint save(s) of step(s) {', '.join(map(str, lost)) or '?'} abandoned, no manifest written"
            )
        if handing:
            said.append(f"step(s) {', '.join(map(str, handing))} committed, not handed over (promotion, replicas)")
        _log.error("%s: %s; last committed step %s", why, "; ".join(said), newest)

    def _stop_workers(self, bound: float | None) -> bool:
        """Stop the threads: unbounded after a full drain; after an abandon, staging and upload (the threads that
        run torch code) get at least :data:`ABANDON_JOIN_S`, the I/O thread (plain Python, waiting on storage) only
        ``bound``."""
        own = bound
        if self.abandoning.is_set():
            own = ABANDON_JOIN_S if bound is None else max(bound, ABANDON_JOIN_S)
        # Upload before I/O: an upload's last submissions (aborting a writer) run before the I/O thread stops.
        stopped = self.stage_worker.stop(own) & self.upload_worker.stop(own)
        io_stopped = self.io_worker.stop(bound)
        if not stopped:
            _log.warning("close: a checkpoint thread is still blocked in storage; it is joined again at exit")
        if stopped and io_stopped:
            self._exit_hook.unregister()
        return stopped

    def _at_exit(self) -> None:
        if self._closed:
            # Closed with threads left (an abandoned save): join them before the interpreter finalizes.
            self._stop_workers(0.0)
            return
        pending = len(self.in_flight_steps())  # type: ignore[attr-defined]
        t0 = time.monotonic()
        done = self.in_flight.drain(self.options.drain_timeout_s)  # type: ignore[attr-defined]
        if pending or not done:  # nothing was outstanding: nothing to report
            _log.warning(
                "interpreter exit: drained %d outstanding checkpoint save(s) in %.2fs (%s); last committed step %s",
                pending,
                time.monotonic() - t0,
                "complete" if done else "timed out, rest abandoned",
                self.committed_step,
            )
        self._closed = True
        if not done:
            self._abandon_outstanding("interpreter exit")
        self._stop_workers(None if done else 0.0)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "in_flight", None):
            _log.warning("AsyncCheckpointer garbage-collected with saves outstanding; call close()")
