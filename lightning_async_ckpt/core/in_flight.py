"""The saves an engine admitted and that have not ended yet, oldest first.

Owned by :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`. The training thread adds handles at the
cut and waits on them (admission, fences, drain); any thread may read them. Ended saves are dropped lazily.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.handle import SaveHandle
from lightning_async_ckpt.core.telemetry import SaveRecord

__all__ = ["InFlight"]


class InFlight:
    """The in-flight saves of one engine (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: deque[SaveHandle] = deque()

    def add(self, handle: SaveHandle) -> None:
        """Track ``handle`` until its ``committed`` future resolves."""
        with self._lock:
            self._handles.append(handle)

    def __bool__(self) -> bool:
        return bool(self._handles)  # a lock-free hint: most steps have nothing in flight

    def handles(self) -> list[SaveHandle]:
        """The tracked handles, oldest first (ended ones included until reaped)."""
        with self._lock:
            return list(self._handles)

    def reap(self) -> None:
        """Drop the saves that ended, from the oldest."""
        with self._lock:
            while self._handles and self._handles[0].done:
                self._handles.popleft()

    def count(self) -> int:
        """Saves admitted and not yet ended."""
        self.reap()
        return len(self._handles)

    def steps(self) -> list[int]:
        """Steps of the saves not yet ended, oldest first."""
        self.reap()
        with self._lock:
            return [h.step for h in self._handles]

    def running_records(self) -> list[SaveRecord]:
        """Records of the saves not yet ended (what a step overlapping them is charged to)."""
        if not self._handles:
            return []
        with self._lock:
            return [h.record for h in self._handles if not h.done]

    def wait_at(self, fence: Fence) -> tuple[float, list[int]]:
        """Block at ``fence`` for every save's storages fenced there; each save's record gets its wait.

        Returns:
            Seconds blocked, and the steps of the saves that made it block.
        """
        waited, steps = 0.0, []
        for handle in self.handles():
            w = handle.wait(fence)
            if w:
                handle.record.fence_wait_s[fence.value] = handle.record.fence_wait_s.get(fence.value, 0.0) + w
                steps.append(handle.step)
            waited += w
        return waited, steps

    def wait_oldest(self) -> None:
        """Block until the oldest save ended (its error, if any, is delivered through the engine's queue)."""
        with self._lock:
            oldest = self._handles[0] if self._handles else None
        if oldest is not None:
            with contextlib.suppress(Exception):  # its error is delivered through raise_pending
                oldest.committed.result()
        self.reap()

    def observe_staged(self) -> None:
        """On the training thread: every save whose staging finished gets its version counters read now, as if its
        fences were reached (a write running during the copy has returned by now; a later one cannot have reached
        the copy). Writes after this point no longer refuse the save."""
        for handle in self.handles():
            job = handle.staging
            if job is not None:
                job.observe()

    def drain(self, timeout: float | None) -> bool:
        """Wait until every tracked save ended (never raises); returns whether they all did within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = True
        for handle in self.handles():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.committed.result(remaining)
            except FutureTimeout:
                finished = False
                break
            except Exception:  # noqa: BLE001 - delivered through raise_pending
                pass
        self.reap()
        return finished
