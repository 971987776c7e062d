"""The persister of ``StagedCheckpointIO``: one ``torch.save`` file at the path Lightning names, published atomically.

No generation folder and no manifest: a fresh temp name created exclusively, fsync, ``os.replace``, fsync the folder
(object stores publish an upload when it completes); the bytes are checksummed as they stream and the size is
checked after publication. Transient failures are retried, never a usage error or a full disk.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from lightning_async_ckpt.core.persist import RetryPolicy, wait_or_abandon
from lightning_async_ckpt.core.stream_persister import PersistWork
from lightning_async_ckpt.errors import CheckpointError, StorageError
from lightning_async_ckpt.storage.backend import backend_for, open_filesystem
from lightning_async_ckpt.storage.io import ChecksumWriter, fsync_dir, read_verified

__all__ = ["CommittedFile", "FilePersister"]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass(frozen=True)
class CommittedFile:
    """One checkpoint file ``StagedCheckpointIO`` made visible.

    Attributes:
        path: The path ``ModelCheckpoint`` asked for.
        size: Bytes written.
        checksum: ``"<algorithm>:<hex>"`` of those bytes, computed as they were streamed.
        blocked_s: Seconds the training thread spent in ``save_checkpoint`` (admission wait and the copy).
        write_s: Seconds from the request to the file being visible.
    """

    path: str
    size: int
    checksum: str
    blocked_s: float
    write_s: float


class FilePersister:
    """Writes each save to the path registered for it with :meth:`expect`, in request order.

    Args:
        checksum: The checksum algorithm of the streamed bytes.
        retry: Which failures are retried, and when.
        verify: Re-read every file once visible and check its size and checksum.
        committed: Where every file made visible is recorded (oldest first).
    """

    collective = False  # one process writes each file
    coordinator = False  # ModelCheckpoint decides what to remove (``remove_checkpoint``), not a retention policy

    def __init__(self, checksum: str, retry: RetryPolicy, verify: bool, committed: deque[CommittedFile]) -> None:
        self.checksum = checksum
        self.retry = retry
        self.verify = verify
        self.committed = committed
        self._paths: dict[int, tuple[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def expect(self, key: int, path: str, storage_options: dict[str, Any]) -> None:
        """Register where the save requested under step ``key`` goes (call before the engine's ``save``)."""
        with self._lock:
            self._paths[key] = (path, storage_options)

    def forget(self, key: int) -> None:
        """Drop the path of a save the engine did not admit."""
        with self._lock:
            self._paths.pop(key, None)

    def persist(self, work: PersistWork) -> CommittedFile:
        """Write ``work``'s state to its path with retries; returns what was made visible.

        Raises:
            CheckpointError: The file was not written (the path named in the message).
        """
        with self._lock:
            path, options = self._paths.pop(work.step)
        record, attempt = work.record, 0
        try:
            while True:
                try:
                    size, checksum = self._write(path, work.state, options)
                    break
                except Exception as exc:
                    if not self.retry.should_retry(exc, attempt):
                        raise
                    attempt += 1
                    _log.warning("writing checkpoint %s failed (%s); retry %d", path, exc, attempt)
                    if wait_or_abandon(self.retry.delay(attempt), work.abandon):
                        raise
        except BaseException as exc:
            raise CheckpointError(f"checkpoint {path} was not written: {type(exc).__name__}: {exc}") from exc
        record.bytes, record.upload_s = size, time.time() - record.t_request
        work.uploaded(size, size)
        written = CommittedFile(path, size, checksum, record.blocked_s, time.time() - record.t_request)
        self.committed.append(written)
        return written

    def close(self) -> None:
        """Nothing to release."""

    def _write(self, path: str, state: Any, options: dict[str, Any]) -> tuple[int, str]:
        fs, fs_path = open_filesystem(path, options)
        backend = backend_for(fs)
        local = backend.kind == "local"
        folder = os.path.dirname(fs_path) if local else fs_path.rsplit("/", 1)[0]
        # Local disk: a temp name in the same folder, renamed once durable. Object stores publish an upload
        # only when it completes, so the final name is written directly.
        # The temp name carries a fresh token: a leftover of a crashed run (containers reuse pids) or of an earlier
        # attempt is never reopened (local files are created exclusively), and no other writer can hold this one.
        token = uuid.uuid4().hex[:12]
        target = os.path.join(folder, f".{os.path.basename(fs_path)}.tmp-{token}") if local else fs_path
        raw = backend.open_write(target, direct_io=False, subfolder=not local)
        stream = ChecksumWriter(raw, self.checksum)
        try:
            torch.save(state, stream)
            backend.finish(raw)
            if local:
                os.replace(target, fs_path)
                fsync_dir(folder)
        except BaseException:
            backend.discard(raw)
            if local and os.path.exists(target):
                os.unlink(target)
            raise
        size = fs.info(fs_path).get("size")
        if size != stream.size:
            raise StorageError(f"checkpoint {path}: wrote {stream.size} bytes but storage holds {size}")
        if self.verify:
            read_verified(fs, fs_path, stream.size, stream.checksum)
        return stream.size, stream.checksum
