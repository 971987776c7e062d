"""The handle of one save (three real futures) and the engine's named worker threads."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lightning_async_ckpt.core.admission import AdmissionDecision
from lightning_async_ckpt.core.capture import CapturePlan, Fence
from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.core.telemetry import SaveRecord

__all__ = ["DrainOnExit", "SaveHandle"]


@dataclass(eq=False)
class SaveHandle:
    """One save request, with three real futures.

    Attributes:
        step: The requested step.
        staged: Resolves when the snapshot no longer aliases application memory (the source may mutate).
        uploaded: Resolves when every byte is stored under the store's contract.
        committed: Resolves to the :class:`~lightning_async_ckpt.storage.manifest.Manifest` once it is durably written:
            only then is the generation recoverable. A skipped or coalesced request's futures are cancelled.
        record: Telemetry of this save.
        decision: The admission decision.
    """

    step: int
    record: SaveRecord
    decision: AdmissionDecision
    staged: Future = field(default_factory=Future)
    uploaded: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    plan: CapturePlan | None = None
    _job: StagingJob | None = None

    @property
    def done(self) -> bool:
        """Whether the save has ended (committed, failed or cancelled)."""
        return self.committed.done()

    def wait(self, fence: Fence) -> float:
        """Block at ``fence`` until this save's storages fenced there are staged; returns seconds blocked."""
        return self._job.wait(fence) if self._job is not None else 0.0

    def result(self, timeout: float | None = None) -> Any:
        """The committed manifest (raises the save's error)."""
        return self.committed.result(timeout)


class _Worker:
    """A named daemon thread running submitted callables in order, optionally at a lower CPU priority."""

    def __init__(self, name: str, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._thread is None:
            # Daemon: the interpreter may exit while storage hangs; the atexit drain bounds that wait.
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def _loop(self) -> None:
        if self.nice:
            # Linux threads carry their own nice value: the upload yields the cores to the training threads.
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                future.set_exception(exc)

    def stop(self, timeout: float | None) -> bool:
        if self._thread is None:
            return True
        self._queue.put(None)
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self._thread = None
        return not alive


class DrainOnExit:
    """Context-manager behaviour shared by the checkpointers: ``close()`` on exit.

    When the body raised, the drain is bounded by ``options.drain_timeout_s`` so the in-flight save lands, and a
    checkpoint error met while unwinding is logged rather than replacing the body's exception.
    """

    options: Any

    def close(self, timeout: float | None = None) -> None:  # pragma: no cover - provided by the subclass
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(timeout=self.options.drain_timeout_s)
        except Exception:  # noqa: BLE001 - the body's exception wins; this one is logged
            logging.getLogger("lightning_async_ckpt").warning("checkpoint error while unwinding", exc_info=True)
