"""A generation restored from a peer, made durable in the background while the restarted job loads and trains.

With ``background=True`` a receiver writes the verified bytes through the page cache without ``fsync``, answers, and
a thread of this module makes every object durable and commits the manifest last (the restart's time was the disk's
write rate otherwise; docs/benchmarks.md). Nothing is listed as committed before its objects are durable and its
manifest written: a crash before that leaves an uncommitted attempt, received again at the next restart. In this
process :func:`manifest_of` answers the manifest the commit will write; :func:`wait_restored` joins the commits (at
exit too).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["DeferredSync", "commit_in_background", "manifest_of", "wait_restored"]

_log = logging.getLogger("lightning_async_ckpt")
_lock = threading.Lock()
_pending: dict[tuple[str, int], tuple[Manifest, threading.Thread]] = {}
_EXIT_WAIT_S = 300.0  # at exit, how long the durable copy of a restored generation may still take


class DeferredSync:
    """A local store's backend whose ``finish`` flushes an object to the page cache without ``fsync``; the
    descriptors are kept for :meth:`sync` (``fsync`` of the same open file, later, off the critical path).

    Args:
        backend: The store's backend (local).
    """

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._fds: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def finish(self, raw: Any) -> None:
        """Flush ``raw`` to the page cache and close it; its ``fsync`` waits for :meth:`sync`."""
        raw.flush()
        self._fds.append(os.dup(raw.fileno()))
        raw.close()

    def forget(self) -> None:
        """Close the kept descriptors without ``fsync`` (the attempt was aborted: nothing of it is committed)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def sync(self) -> None:
        """``fsync`` every object finished so far (each through a duplicate of its descriptor) and close them."""
        fds, self._fds = self._fds, []
        try:
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)


def commit_in_background(writer: Any, backend: DeferredSync, manifest: Manifest, **commit: Any) -> Manifest:
    """Make ``writer``'s objects durable and commit it (``writer.commit(**commit)``) on a thread of its own.

    Args:
        writer: A :class:`~lightning_async_ckpt.storage.writer.GenerationWriter` whose objects are all closed,
            through ``backend``.
        backend: The writer's store's :class:`DeferredSync` backend.
        manifest: The source's manifest (the received objects were checked against it).
        **commit: ``writer.commit``'s arguments.

    Returns:
        The manifest the commit writes, as far as readers use it (objects with their keys; ``committed_at`` 0 until
        then): :func:`manifest_of` answers it meanwhile.
    """
    preview = replace(manifest, run_id=writer.store.run_id, objects=tuple(writer.objects), committed_at=0.0)
    key = (writer.store.uri.rstrip("/"), writer.step)

    def run() -> None:
        started = time.monotonic()
        try:
            backend.sync()
            writer.commit(**commit)
            _log.info(
                "restored step %d is durable in %s (%.2f s after it was received)",
                writer.step,
                writer.store.uri,
                time.monotonic() - started,
            )
        except Exception:  # noqa: BLE001 - the copy stays uncommitted; a later restart receives it again
            _log.warning(
                "the restored copy of step %d in %s could not be made durable; it stays uncommitted (the peer and "
                "the durable tier still hold it)",
                writer.step,
                writer.store.uri,
                exc_info=True,
            )
            try:
                writer.abort()
            except Exception:  # noqa: BLE001 - best effort: an uncommitted attempt is never listed
                _log.debug("aborting the restored copy failed", exc_info=True)
        finally:
            with _lock:
                _pending.pop(key, None)

    thread = threading.Thread(target=run, name="lightning-async-ckpt-restored-commit", daemon=True)
    with _lock:
        _pending[key] = (preview, thread)
    thread.start()
    return preview


def manifest_of(store: CheckpointStore, step: int) -> Manifest:
    """The manifest of generation ``step`` of ``store``: the one a background commit of this process is writing,
    else the committed one.

    Raises:
        ManifestError: Neither (``store.manifest``'s errors).
    """
    with _lock:
        pending = _pending.get((store.uri.rstrip("/"), step))
    return pending[0] if pending is not None else store.manifest(step)


def wait_restored(timeout: float | None = None) -> bool:
    """Join this process's background commits of restored generations; whether all ended within ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        threads = [thread for _, thread in _pending.values()]
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


atexit.register(wait_restored, _EXIT_WAIT_S)
