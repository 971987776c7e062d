"""Handles of the processes that do not write: they mirror the main process's fully asynchronous saves.

The main process reports ended saves with every collective (:meth:`MirrorBook.report`); a report leaves its queue
only after a collective delivered it (:meth:`MirrorBook.delivered`), so a failed collective loses nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning_async_ckpt.core.engine import SaveHandle
from lightning_async_ckpt.core.telemetry import SaveRecord
from lightning_async_ckpt.errors import CheckpointError

__all__ = ["MirrorBook"]


class MirrorBook:
    """The main process's ended saves to report, and the other processes' mirror handles by step.

    Thread-safety: used on the training thread only.
    """

    def __init__(self, main: bool) -> None:
        self.main = main
        self._reportable: deque[SaveHandle] = deque()
        self._mirrors: dict[int, SaveHandle] = {}

    def track(self, handle: SaveHandle) -> None:
        """Main process: report ``handle``'s outcome once it ended."""
        self._reportable.append(handle)

    def mirror(self, handle: SaveHandle) -> None:
        """Other processes: resolve ``handle`` from the main process's report of its step."""
        self._mirrors[handle.step] = handle

    def mirror_of(self, step: int, decision: Any) -> SaveHandle:
        """Other processes: a handle mirroring the main process's save of ``step`` (``decision``: its admission)."""
        handle = SaveHandle(step=step, record=SaveRecord(requested_step=step), decision=decision)
        if decision.admitted:
            handle.staged.set_result(step)
            self.mirror(handle)
        else:
            for fut in (handle.staged, handle.uploaded, handle.committed):
                fut.cancel()
        return handle

    def report(self) -> list[tuple[int, str, Any]]:
        """Main process: the ended saves not delivered yet, oldest first, as ``(step, outcome, value)``."""
        out: list[tuple[int, str, Any]] = []
        if not self.main:
            return out
        for handle in self._reportable:
            if not handle.done:
                break
            fut = handle.committed
            if fut.cancelled():
                out.append((handle.step, "cancelled", None))
            elif fut.exception() is not None:
                out.append((handle.step, "failed", str(fut.exception())))
            else:
                out.append((handle.step, "committed", fut.result()))
        return out

    def delivered(self, count: int) -> None:
        """Main process: the first ``count`` reported saves reached every process."""
        for _ in range(count if self.main else 0):
            self._reportable.popleft()

    def absorb(self, report: list[tuple[int, str, Any]]) -> None:
        """Other processes: resolve the mirrors the main process's report names."""
        if self.main:
            return
        for step, outcome, value in report:
            handle = self._mirrors.pop(step, None)
            if handle is None:
                continue
            if outcome == "committed":
                handle.uploaded.set_result(value.total_bytes)
                handle.committed.set_result(value)
            elif outcome == "failed":
                error = CheckpointError(f"checkpoint for step {step} failed on the main process: {value}")
                handle.uploaded.set_exception(error)
                handle.committed.set_exception(error)
            else:
                handle.uploaded.cancel()
                handle.committed.cancel()

    def cancel_all(self) -> None:
        """Other processes, at close: mirrors no report can reach any more are cancelled."""
        for handle in self._mirrors.values():
            for fut in (handle.uploaded, handle.committed):
                fut.cancel()
        self._mirrors.clear()
