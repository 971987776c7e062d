"""Where the engine's work runs: named worker threads, and the one interpreter-exit trampoline.

Worker threads are daemons, but never left to the interpreter while they may touch torch or storage:
:func:`register_at_exit` drains within the bound, flags the rest abandoned and joins the threads (bounded) before
finalization, where a daemon thread waking in a C++ frame would abort the process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["THREAD_PREFIX", "ExitHook", "Worker", "register_at_exit"]

THREAD_PREFIX = "lightning_async_ckpt"
_log = logging.getLogger("lightning_async_ckpt")


class Worker:
    """A named daemon thread running submitted callables in order, optionally at a lower CPU priority.

    Created lazily on the first :meth:`submit`. Thread-safe: any thread may submit; :meth:`stop` is called by
    the owner once.

    Args:
        name: Thread name (prefixed with ``lightning_async_ckpt-`` by convention).
        nice: Linux nice value of the thread (0 leaves it unchanged).
    """

    def __init__(self, name: str, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = False

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the thread after everything submitted before; returns its future.

        Once :meth:`stop` was called no thread is started any more: ``fn`` runs on the caller's thread.
        """
        future: Future = Future()
        with self._lock:
            stopping = self._stopping
            if not stopping:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                    self._thread.start()
                self._queue.put((fn, future))
        if stopping:
            _run(fn, future)
        return future

    def _loop(self) -> None:
        if self.nice:
            # Linux threads carry their own nice value: the upload yields the cores to the training threads.
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while (item := self._queue.get()) is not None:
            _run(*item)

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (new work then runs on the caller's thread)."""
        return self._stopping

    @property
    def alive(self) -> bool:
        """Whether the thread exists and has not ended."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float | None) -> bool:
        """Ask the thread to end after its queued work and join it for at most ``timeout`` seconds.

        Returns:
            True when the thread ended (or never started).
        """
        with self._lock:
            thread = self._thread
            if not self._stopping and thread is not None:
                self._queue.put(None)
            self._stopping = True
            if thread is None:
                return True
        thread.join(timeout)
        return not thread.is_alive()

    def join(self, timeout: float | None) -> bool:
        """Join the thread (after :meth:`stop`) for at most ``timeout`` seconds; True when it ended."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()


def _run(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - delivered through the future
        future.set_exception(exc)


class ExitHook:
    """A registration made by :func:`register_at_exit`; :meth:`unregister` removes it (idempotent)."""

    def __init__(self, ref: weakref.ReferenceType | Callable[[], Any]) -> None:
        self._ref = ref

    def unregister(self) -> None:
        """Do not call the callback at interpreter exit."""
        with _registry_lock:
            if self in _hooks:
                _hooks.remove(self)

    def _callback(self) -> Callable[[], Any] | None:
        return self._ref()  # type: ignore[call-arg]


_hooks: list[ExitHook] = []
_registry_lock = threading.Lock()
_installed = False


def register_at_exit(method: Callable[[], Any]) -> ExitHook:
    """Call the bound method ``method`` at interpreter exit, before finalization, unless its object is gone.

    One trampoline runs every checkpointer's callback newest first (like :mod:`atexit`), each with its exceptions
    logged; the owner is only weakly referenced, so an unclosed checkpointer can still be garbage-collected.

    Args:
        method: A bound method (held through a weak reference) or a plain function (held strongly).

    Returns:
        The registration; call :meth:`ExitHook.unregister` once the owner was closed.
    """
    global _installed
    try:
        ref: Any = weakref.WeakMethod(method)  # type: ignore[arg-type]
    except TypeError:
        ref = lambda: method  # noqa: E731 - a plain function is held strongly

    hook = ExitHook(ref)
    with _registry_lock:
        _hooks.append(hook)
        if not _installed:
            atexit.register(_run_exit_hooks)
            _installed = True
    return hook


def _run_exit_hooks() -> None:
    while True:
        with _registry_lock:
            if not _hooks:
                return
            hook = _hooks.pop()
        callback = hook._callback()
        if callback is None:
            continue
        try:
            callback()
        except Exception:  # noqa: BLE001 - nothing can be raised at interpreter exit; it is logged
            _log.warning("checkpoint exit handler failed", exc_info=True)
