"""``StagedCheckpointIO``: this library's staging, durable commit and error surfacing behind Lightning's plugin seam.

``Trainer(plugins=[StagedCheckpointIO()])`` writes the files ``TorchCheckpointIO`` writes, at the same paths, but
copies into pooled host buffers at the save, publishes each file atomically once durable, raises a background
failure once, and runs ``remove_checkpoint`` only after the newer saves requested before it committed. It is the
one engine with a persister that writes the path Lightning names
(:class:`~lightning_async_ckpt.lightning.file_persister.FilePersister`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import sys
import time
from concurrent.futures import Future
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.options import CheckpointOptions
from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.staging import BufferPool, resolve_budget
from lightning_async_ckpt.errors import CheckpointError, ConfigError
from lightning_async_ckpt.lightning.file_persister import CommittedFile, FilePersister
from lightning_async_ckpt.storage.backend import open_filesystem
from lightning_async_ckpt.storage.io import DEFAULT_CHECKSUM, Checksum

__all__ = ["CommittedFile", "StagedCheckpointIO"]

_log = logging.getLogger("lightning_async_ckpt")


class StagedCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stages into reused host buffers and writes in the background.

    Use it with your own ``ModelCheckpoint``: ``Trainer(callbacks=[ModelCheckpoint(...)], plugins=
    [StagedCheckpointIO()])``. The files, names and contents are those ``TorchCheckpointIO`` writes.

    Thread-safety: every method is called from the training thread; the writes run on the engine's named threads,
    in request order, created lazily and stopped at :meth:`teardown` (a later ``fit`` opens a new engine).

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
        resolve_budget(host_memory_budget)  # validates the budget now
        self.storage_options = dict(storage_options or {})
        self.max_outstanding = max_outstanding
        self.host_memory_budget = host_memory_budget
        self.retry = RetryPolicy(retries=retries, backoff_s=retry_backoff_s)
        self.verify = bool(verify)
        self.drain_timeout_s = float(drain_timeout_s)
        #: Every file made visible, oldest first (bounded).
        self.committed: collections.deque[CommittedFile] = collections.deque(maxlen=10_000)
        self._requests = itertools.count()  # the engine's step of each save (Lightning may save one step twice)
        self._saves: collections.deque[Future] = collections.deque()
        self._removals: collections.deque[Future] = collections.deque()
        self._open()

    def _open(self) -> None:
        self._persister = FilePersister(self.checksum, self.retry, self.verify, self.committed)
        options = CheckpointOptions(
            max_outstanding=self.max_outstanding,
            admission="wait",
            host_memory_budget=self.host_memory_budget,
            guard="off",  # nothing is deferred: every tensor is copied at the save
            drain_timeout_s=self.drain_timeout_s,
        )
        self._engine = AsyncCheckpointer(None, options, persister=self._persister)

    @property
    def pool(self) -> BufferPool:
        """The staging pool the current engine reuses from one save to the next."""
        return self._engine.pool

    # -- CheckpointIO --------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Copy ``checkpoint``'s tensors into pooled host buffers now and write ``path`` in the background.

        Raises:
            CheckpointError: An earlier background save or removal failed (raised once).
            HostMemoryBudgetError: The checkpoint does not fit ``host_memory_budget``.
        """
        options = self._options(storage_options)
        if self._engine.closed:
            self._open()  # torn down after an earlier fit
        key = next(self._requests)
        self._persister.expect(key, os.fspath(path), options)
        try:
            handle = self._engine.save(key, checkpoint, defer=False)  # no proof: every tensor is copied here
        except BaseException:
            self._persister.forget(key)
            raise
        self._saves.append(handle.committed)
        while self._saves and self._saves[0].done():
            self._saves.popleft()

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` once every save requested before this call committed; keep it if one failed."""
        target, options, before = os.fspath(path), self._options(None), list(self._saves)
        # The engine's upload thread runs persists in request order: this runs after every earlier save ended.
        self._removals.append(self._engine.upload_worker.submit(lambda: self._remove(target, before, options)))
        while self._removals and self._removals[0].done():
            self._removals.popleft()

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
        """Drain every queued save and removal, stop the threads, and raise a background error not raised yet.

        While another exception propagates (Lightning tears down after a training error) the error is logged
        instead, so the training error is the one that surfaces.

        Raises:
            CheckpointError: The oldest error not raised yet (later ones are attached as notes).
        """
        propagating = sys.exc_info()[1] is not None
        self._wait_removals(None)
        try:
            self._engine.close()
        except CheckpointError as error:
            if not propagating:
                raise
            # Lightning tears down while an exception propagates: that exception stays the one the user sees.
            _log.error("checkpoint write failed while another exception was handled: %s", error)

    # -- public helpers ------------------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued save and removal ended, then raise a pending background error (once).

        Returns:
            True when everything ended within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = self._engine.drain_quietly(timeout)
        finished = self._wait_removals(None if deadline is None else max(0.0, deadline - time.monotonic())) and finished
        self._engine.raise_pending()
        return finished

    @property
    def outstanding(self) -> int:
        """Saves queued or being written."""
        return self._engine.outstanding

    # -- background --------------------------------------------------------------------------------------
    def _remove(self, path: str, before: list[Future], options: dict[str, Any]) -> None:
        failed = [f for f in before if f.done() and not f.cancelled() and f.exception() is not None]
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
            self._engine.report_error(error)
            raise error from exc

    def _wait_removals(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for task in list(self._removals):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                task.exception(remaining)
            except TimeoutError:
                return False
        while self._removals and self._removals[0].done():
            self._removals.popleft()
        return True

    def _options(self, storage_options: Any) -> dict[str, Any]:
        if storage_options is None:
            return self.storage_options
        if not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
        return {**self.storage_options, **storage_options}
