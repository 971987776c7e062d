"""``StagedCheckpointIO``: this library's staging, durable commit and error surfacing behind Lightning's plugin seam.

For users who keep their ``ModelCheckpoint`` (monitor, top-k, filenames, ``save_last``): ``Trainer(plugins=
[StagedCheckpointIO()])`` writes the same files ``TorchCheckpointIO`` writes, at the same paths, but

* at the save, tensors are copied into **pooled host buffers** reused from one checkpoint to the next (pinned on
  CUDA), instead of ``AsyncCheckpointIO``'s fresh deep copy per save;
* the file is written on a background thread as a checksummed stream and made visible **atomically** once
  durable (local disk: temp file in the same folder, fsync, ``os.replace``, fsync the folder; object stores: the
  upload is published when it completes), so a reader never sees a partial checkpoint;
* a background failure is raised **once** on the training thread, at the next ``save_checkpoint`` or at teardown
  (Lightning's ``AsyncCheckpointIO`` keeps its error and re-raises it on every later save);
* ``remove_checkpoint`` (a top-k replacement, a previous ``last``) runs **after** the newer saves requested before it
  committed, and not at all when one of them failed: the checkpoint being replaced is never deleted first.

Call sequence (all on the training thread): ``save_checkpoint`` (copy into the pool, queue the write) ->
``remove_checkpoint`` (queued behind the saves) -> ``load_checkpoint`` (drains first) -> ``teardown`` (drains,
stops the thread, raises a pending error).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_async_ckpt.core.capture import CapturePlan
from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.staging import BufferPool, StagingJob, resolve_budget
from lightning_async_ckpt.core.workers import THREAD_PREFIX, Worker, register_at_exit
from lightning_async_ckpt.errors import CheckpointError, ConfigError, StorageError
from lightning_async_ckpt.storage.backend import backend_for, open_filesystem
from lightning_async_ckpt.storage.io import DEFAULT_CHECKSUM, Checksum, WriteOnlyStream, fsync_dir, read_verified

__all__ = ["CommittedFile", "StagedCheckpointIO"]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass(frozen=True)
class CommittedFile:
    """One checkpoint file this plugin made visible.

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


class _ChecksumStream(WriteOnlyStream):
    """Counts and checksums the bytes ``torch.save`` writes into ``raw``."""

    def __init__(self, raw: Any, algorithm: str) -> None:
        self._raw = raw
        self._sum = Checksum(algorithm)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view)
        self._sum.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._raw.flush()

    @property
    def checksum(self) -> str:
        return self._sum.hexdigest()


class StagedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stages into reused host buffers and writes in the background.

    Use it with your own ``ModelCheckpoint``: ``Trainer(callbacks=[ModelCheckpoint(...)], plugins=
    [StagedCheckpointIO()])``. The files, names and contents are those ``TorchCheckpointIO`` writes.

    Thread-safety: every method is called from the training thread; the writes run on one named thread
    (``lightning_async_ckpt-checkpoint-io``), in request order, created lazily and stopped at :meth:`teardown`.

    Args:
        storage_options: fsspec options for every path (e.g. an S3 ``endpoint_url``, ``key``, ``secret``); a
            ``storage_options`` passed to ``trainer.save_checkpoint`` is merged over them.
        max_outstanding: Saves in flight at once; a save beyond it waits (on the training thread) for the oldest.
        host_memory_budget: Most bytes the staging pool may retain: bytes, ``"auto"`` (half the available host
            memory) or ``None`` (no limit).
        retries: Extra attempts after a transient storage failure (never after a usage error or a full disk).
        retry_backoff_s: Delay before the first retry; doubles per attempt.
        checksum: ``"crc32c"`` (default where installed), ``"crc32"`` or ``"sha256"``.
        verify: Re-read every file once it is visible and check its size and checksum (costs one read).
        drain_timeout_s: Bound on the drain at interpreter exit.

    Raises:
        ConfigError: A bad argument (named in the message).
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        max_outstanding: int = 1,
        host_memory_budget: int | str | None = "auto",
        retries: int = 2,
        retry_backoff_s: float = 0.5,
        checksum: str | None = None,
        verify: bool = False,
        drain_timeout_s: float = 600.0,
    ) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        if isinstance(max_outstanding, bool) or not isinstance(max_outstanding, int) or max_outstanding < 1:
            raise ConfigError(f"max_outstanding must be an int >= 1, got {max_outstanding!r}")
        if not isinstance(drain_timeout_s, int | float) or drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be a number >= 0, got {drain_timeout_s!r}")
        self.checksum = checksum or DEFAULT_CHECKSUM
        Checksum(self.checksum)  # validates the algorithm now, not at the first save
        self.storage_options = dict(storage_options or {})
        self.max_outstanding = max_outstanding
        self.retry = RetryPolicy(retries=retries, backoff_s=retry_backoff_s)
        self.verify = bool(verify)
        self.drain_timeout_s = float(drain_timeout_s)
        self.pool = BufferPool(resolve_budget(host_memory_budget))
        #: Every file made visible, oldest first (bounded).
        self.committed: collections.deque[CommittedFile] = collections.deque(maxlen=10_000)
        self._saves: collections.deque[Future] = collections.deque()
        self._tasks: collections.deque[Future] = collections.deque()
        self._errors: collections.deque[BaseException] = collections.deque()
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._exit_hook: Any = None

    # -- CheckpointIO --------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Copy ``checkpoint``'s tensors into pooled host buffers now and write ``path`` in the background.

        Raises:
            CheckpointError: An earlier background save or removal failed (raised once).
            HostMemoryBudgetError: The checkpoint does not fit ``host_memory_budget``.
        """
        options = self._options(storage_options)
        self._raise_pending()
        t0 = time.perf_counter()
        while self._outstanding() >= self.max_outstanding:
            with contextlib.suppress(Exception):  # its error is in the queue, raised just below
                self._saves[0].result()
        self._raise_pending()
        plan = CapturePlan.build(checkpoint)  # no proof: every tensor is copied here, at the save
        self.pool.check(plan.total_bytes)
        buffers = self.pool.acquire(plan.slots)
        job = StagingJob(plan.slots, buffers, guard=False)
        try:
            job.copy_at_cut()
        except BaseException:
            self.pool.release(buffers)
            raise
        blocked = time.perf_counter() - t0
        target = os.fspath(path)
        future = self._submit(lambda: self._save(target, plan, job, buffers, options, t0, blocked))
        with self._lock:
            self._saves.append(future)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` once every save requested before this call committed; keep it if one failed."""
        target = os.fspath(path)
        with self._lock:
            before = list(self._saves)
        self._submit(lambda: self._remove(target, before, self._options(None)))

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load ``path`` with ``torch.load`` through fsspec and this plugin's ``storage_options``.

        Outstanding writes are drained first, so a checkpoint saved a moment ago loads.

        Raises:
            FileNotFoundError: Nothing at ``path``.
        """
        self.drain()
        target = os.fspath(path)
        fs, fs_path = open_filesystem(target, self.storage_options)
        if not fs.exists(fs_path):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        with fs.open(fs_path, "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=weights_only)

    @override
    def teardown(self) -> None:
        """Drain every queued save and removal, stop the thread, and raise a background error not raised yet.

        While another exception propagates (Lightning tears down after a training error) the error is logged
        instead, so the training error is the one that surfaces.

        Raises:
            CheckpointError: The oldest error not raised yet (later ones are attached as notes).
        """
        self._wait_all(None)
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(None)
        if self._exit_hook is not None:
            self._exit_hook.unregister()
            self._exit_hook = None
        self.pool.clear()
        error = None
        while self._errors:
            later = self._errors.popleft()
            if error is None:
                error = later
            else:
                error.add_note(f"another checkpoint write also failed: {later}")
        if error is None:
            return
        if sys.exc_info()[1] is not None:
            # Lightning tears down while an exception propagates: that exception stays the one the user sees.
            _log.error("checkpoint write failed while another exception was handled: %s", error)
            return
        raise error

    # -- public helpers ------------------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued save and removal ended, then raise a pending background error (once).

        Returns:
            True when everything ended within ``timeout``.
        """
        finished = self._wait_all(timeout)
        self._raise_pending()
        return finished

    @property
    def outstanding(self) -> int:
        """Saves queued or being written."""
        return self._outstanding()

    # -- background --------------------------------------------------------------------------------------
    def _save(
        self,
        path: str,
        plan: CapturePlan,
        job: StagingJob,
        buffers: list[torch.Tensor],
        options: dict[str, Any],
        t0: float,
        blocked: float,
    ) -> CommittedFile:
        try:
            job.run()  # nothing is deferred: this only waits for CUDA copies issued at the save
            if job.error is not None:
                raise job.error
            state = plan.materialize(buffers)
            attempt = 0
            while True:
                try:
                    size, checksum = self._write(path, state, options)
                    break
                except Exception as exc:
                    if not self.retry.should_retry(exc, attempt):
                        raise
                    attempt += 1
                    _log.warning("writing checkpoint %s failed (%s); retry %d", path, exc, attempt)
                    time.sleep(self.retry.delay(attempt))
        except BaseException as exc:
            error = CheckpointError(f"checkpoint {path} was not written: {type(exc).__name__}: {exc}")
            self._errors.append(error)
            raise error from exc
        finally:
            self.pool.release(buffers)
        record = CommittedFile(path, size, checksum, blocked, time.perf_counter() - t0)
        self.committed.append(record)
        return record

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
        stream = _ChecksumStream(raw, self.checksum)
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

    def _remove(self, path: str, before: list[Future], options: dict[str, Any]) -> None:
        failed = [f for f in before if f.exception() is not None]
        if failed:
            _log.warning(
                "kept checkpoint %s: a newer checkpoint requested before its removal was not written (%s)",
                path,
                failed[0].exception(),
            )
            return
        try:
            fs, fs_path = open_filesystem(path, options)
            if fs.exists(fs_path):
                fs.rm(fs_path, recursive=True)
        except Exception as exc:
            error = CheckpointError(f"could not remove checkpoint {path}: {type(exc).__name__}: {exc}")
            self._errors.append(error)
            raise error from exc

    # -- plumbing ------------------------------------------------------------------------------------------
    def _submit(self, fn: Any) -> Future:
        if self._worker is None:
            self._worker = Worker(f"{THREAD_PREFIX}-checkpoint-io")
            self._exit_hook = register_at_exit(self._at_exit)
        future = self._worker.submit(fn)
        with self._lock:
            self._tasks.append(future)
        return future

    def _outstanding(self) -> int:
        with self._lock:
            while self._saves and self._saves[0].done():
                self._saves.popleft()
            return len(self._saves)

    def _wait_all(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                task.exception(remaining)
            except TimeoutError:
                return False
        with self._lock:
            while self._tasks and self._tasks[0].done():
                self._tasks.popleft()
        self._outstanding()
        return True

    def _raise_pending(self) -> None:
        if self._errors:
            raise self._errors.popleft()

    def _options(self, storage_options: Any) -> dict[str, Any]:
        if storage_options is None:
            return self.storage_options
        if not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
        return {**self.storage_options, **storage_options}

    def _at_exit(self) -> None:
        with self._lock:
            pending = sum(1 for f in self._tasks if not f.done())
        if pending:
            done = self._wait_all(self.drain_timeout_s)
            _log.warning(
                "interpreter exit: %s %d outstanding checkpoint write(s) of StagedCheckpointIO",
                "drained" if done else "timed out draining",
                pending,
            )
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(0.0 if pending else None)
