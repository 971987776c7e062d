"""Saves this process has in flight, by store location: what a reader in the same process waits for.

Writers record each admitted save (:func:`track`); readers call :func:`wait_for` before they choose, which waits,
bounded and logged, for every save of this process whose location is the reader's, inside it, or contains it, so a
load right after a save never silently picks an older generation. The registry is process-wide and weak: it never
keeps a checkpointer, a store or a snapshot alive.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from lightning_async_ckpt.errors import CheckpointError

__all__ = ["DEFAULT_WAIT_S", "location_of", "pending", "track", "wait_for"]

_log = logging.getLogger("lightning_async_ckpt")
DEFAULT_WAIT_S = 600.0
_WORKER_PREFIX = "lightning_async_ckpt"  # the engine's own threads (stage, upload, io) never wait for themselves

_lock = threading.Lock()
_saves: dict[str, weakref.WeakKeyDictionary[Future, int]] = {}


def location_of(store: Any, step: int) -> str | None:
    """The registry key of save ``step`` into ``store``: its root as a real local path, or as a URL with its
    protocol. A store whose generations do not live under its root answers itself with an ``inflight_location(step)``
    method (a local folder, or ``None``: not tracked)."""
    own = getattr(store, "inflight_location", None)
    if callable(own):
        folder = own(step)
        return None if folder is None else os.path.realpath(folder)
    if getattr(store, "is_local", False):
        return os.path.realpath(store.root)
    return store.backend.url(store.root).rstrip("/")


def _location(uri: str, storage_options: dict[str, Any] | None) -> str:
    from lightning_async_ckpt.storage.backend import backend_for, open_filesystem

    fs, root = open_filesystem(uri, dict(storage_options or {}))
    backend = backend_for(fs, None)
    root = root.rstrip("/") or "/"
    return os.path.realpath(root) if backend.kind == "local" else backend.url(root).rstrip("/")


def track(store: Any, step: int, committed: Future) -> None:
    """Record an admitted save of ``step`` into ``store`` until ``committed`` resolves (call it at the request)."""
    key = location_of(store, step)
    if key is None or committed.done():
        return
    with _lock:
        _saves.setdefault(key, weakref.WeakKeyDictionary())[committed] = step
    committed.add_done_callback(lambda fut: _forget(key, fut))


def _forget(key: str, fut: Future) -> None:
    with _lock:
        saves = _saves.get(key)
        if saves is not None:
            saves.pop(fut, None)
            if not saves:
                _saves.pop(key, None)


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def pending(uri: str, storage_options: dict[str, Any] | None = None) -> dict[Future, tuple[str, int]]:
    """This process's saves in flight at ``uri``, inside it or around it: ``{committed future: (location, step)}``."""
    with _lock:
        if not _saves:
            return {}  # nothing in flight anywhere: no filesystem is opened
    where = _location(uri, storage_options)
    with _lock:
        return {
            fut: (key, step)
            for key, saves in _saves.items()
            if _related(key, where)
            for fut, step in list(saves.items())
            if not fut.done()
        }


def wait_for(
    uri: str,
    storage_options: dict[str, Any] | None = None,
    *,
    timeout_s: float = DEFAULT_WAIT_S,
    doing: str = "loading",
) -> float:
    """Wait until this process's saves in flight at ``uri`` (or inside or around it) have ended; log the wait.

    A save that fails ends too: its owner raises its error, and the reader then chooses among what is committed.

    Args:
        uri: The location about to be read.
        storage_options: fsspec options for ``uri``.
        timeout_s: The longest wait.
        doing: What the caller is about to do, for the log line and the error.

    Returns:
        Seconds waited.

    Raises:
        CheckpointError: A save was still in flight after ``timeout_s``; choosing now would pick an older
            generation without saying so.
    """
    if threading.current_thread().name.startswith(_WORKER_PREFIX):
        return 0.0
    saves = pending(uri, storage_options)
    if not saves:
        return 0.0
    steps = sorted({step for _, step in saves.values()})
    _log.info(
        "%s %s: waiting up to %gs for %d save(s) of this process still in flight there (steps %s)",
        doing,
        uri,
        timeout_s,
        len(saves),
        steps,
    )
    t0 = time.perf_counter()
    _, not_done = wait_futures(list(saves), timeout=timeout_s)
    waited = time.perf_counter() - t0
    if not_done:
        late = sorted({saves[f][1] for f in not_done})
        raise CheckpointError(
            f"{doing} {uri}: save(s) of steps {late} made by this process are still in flight after {timeout_s:g}s; "
            "choosing now would silently pick an older checkpoint. Drain the checkpointer first (close() it, or "
            "wait for the save handle's committed future), then load"
        )
    _log.info("%s %s: waited %.2fs for steps %s to end", doing, uri, waited, steps)
    return waited
