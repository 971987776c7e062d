"""Asynchronous sharded checkpoints for plain loops and raw FSDP2: the one engine with a DCP persister.

The sharded capturer and the DCP persister (``dcp.save`` on the upload thread over a gloo group of its own) plug
into :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`. Every rank checks its guard before it reports its
objects; the coordinator writes the manifest last. One save is in flight at a time.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.options import CheckpointOptions
from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.errors import ConfigError, check_number
from lightning_async_ckpt.sharded.capture import ShardedCapturer
from lightning_async_ckpt.sharded.handle import ShardedSaveError, ShardedSaveHandle
from lightning_async_ckpt.sharded.persister import DcpPersister
from lightning_async_ckpt.sharded.plan_cache import new_cache_key, plan_caching_available
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["ShardedCheckpointer", "ShardedSaveError", "ShardedSaveHandle"]

_log = logging.getLogger(__name__)


class ShardedCheckpointer(AsyncCheckpointer):
    """Asynchronous DCP-format checkpoints of a sharded (or plain) state dict into a :class:`CheckpointStore`.

    Every rank constructs one (a collective: it creates the gloo group) and calls :meth:`save` at the same steps;
    one save is in flight at a time. Local shards are copied at the cut unless the caller passes fences
    (:meth:`attach`, or :meth:`declare_fences` plus :meth:`wait`) and the deferral proof holds. A background failure
    is raised once on the training thread, on every rank. A save the guard refused on any rank ends ``torn`` on
    every rank (:class:`ShardedSaveError` with ``torn`` set, :attr:`retake_due`), as with the single-writer engine.

    Thread-safety: call ``save``, ``drain`` and ``close`` from one thread (the training thread).

    Args:
        store: A :class:`CheckpointStore` or its URL (local path, ``s3://...``, any fsspec URL).
        process_group: The group to checkpoint over. Default: a new gloo group over all ranks when
            ``torch.distributed`` is initialized, none in a single process.
        timeout_s: Timeout of the gloo group created here: no collective of a save waits longer.
        thread_count: DCP's I/O threads per rank.
        storage_options: Passed to the store when ``store`` is a URL.
        run_id: Run id of the store when ``store`` is a URL. Default: a new id, the same on every rank (broadcast
            from rank 0 of the group). Pass a store object with the same ``run_id`` on every rank otherwise.
        keep_last: After each commit, the coordinator removes this run's committed generations older than the newest
            ``keep_last`` (whole generations, manifest first; see ``CheckpointStore.gc``). ``None`` keeps all.
        guard: The runtime guard on deferred shards (``True``/``"full"`` exact, ``"sample"`` or ``False``/``"off"``;
            see :mod:`lightning_async_ckpt.core.guard`): a torn copy refuses the save on every rank.
        host_memory_budget: Bytes of pooled host buffers this rank may retain (``"auto"``: half the available host
            memory; ``None``: no limit).
        write_retry: Retries of a write the object store throttled (503 SlowDown, 429, a reset connection), with
            jittered backoff (default :data:`~lightning_async_ckpt.sharded.write_retry.DEFAULT_WRITE_RETRY`: 4
            retries from 0.5 s); the manifest counts them per rank (``extra["write_retries"]``).
        plan_caching: Let DCP cache save plans where the installed torch can (:mod:`.plan_cache`): an unchanged
            plan is not gathered and scattered again on every save.
        options: More engine settings (``on_error``, ``event_log``, ``drain_timeout_s``, ...); the arguments above
            override its fields; admission is always ``"wait"`` with one save in flight (every rank takes part in
            every save) and a failed save is not retried as a whole (DCP's writes retry throttling themselves).

    Raises:
        ConfigError: A bad argument.
    """

    writes_dcp = True  # every rank writes DCP files (core.interfaces.TrainingCheckpointer)

    def __init__(
        self,
        store: CheckpointStore | str,
        *,
        process_group: Any = None,
        timeout_s: float = 300.0,
        thread_count: int = 1,
        storage_options: dict[str, Any] | None = None,
        run_id: str | None = None,
        keep_last: int | None = None,
        guard: bool | str = True,
        host_memory_budget: int | str | None = None,
        write_retry: RetryPolicy | None = None,
        plan_caching: bool = True,
        options: CheckpointOptions | None = None,
    ) -> None:
        check_number("timeout_s", timeout_s, integer=False, above=True, hint=" (seconds)")
        check_number("thread_count", thread_count, 1)
        check_number("keep_last", keep_last, 1, optional=True, hint=" (None keeps everything)")
        if write_retry is not None and not isinstance(write_retry, RetryPolicy):
            raise ConfigError(f"write_retry must be a RetryPolicy or None, got {write_retry!r}")
        if options is not None and not isinstance(options, CheckpointOptions):
            raise ConfigError(f"options must be a CheckpointOptions or None, got {type(options).__name__}")
        fields = {
            **(options.__dict__ if options is not None else {}),
            "keep_last": keep_last,
            "guard": guard,
            "host_memory_budget": host_memory_budget,
            "admission": "wait",
            "max_outstanding": 1,
            "retries": 0,
        }
        engine_options = CheckpointOptions(**fields)  # validates guard and budget now (ConfigError)
        self.timeout_s = float(timeout_s)
        self.thread_count = thread_count
        self.keep_last = keep_last
        self.guard = guard
        self.write_retry = write_retry
        self._own_group = False
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self._own_group = True
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        if not isinstance(store, CheckpointStore):
            if run_id is None and process_group is not None:
                # One run id on every rank: the coordinator's manifest names it, retention keys on it.
                ids = [CheckpointStore.new_run_id()]
                dist.broadcast_object_list(ids, src=dist.get_global_rank(process_group, 0), group=process_group)
                run_id = ids[0]
            store = self._open_store(store, storage_options, run_id)
        persister = self._make_persister(store, plan_caching)
        target = self._make_target(store)
        super().__init__(store, engine_options, persister=persister, capturer=ShardedCapturer(), target=target)

    def _open_store(self, uri: str, storage_options: dict[str, Any] | None, run_id: str | None) -> CheckpointStore:
        """The store for ``uri`` (the tiered checkpointer opens this rank's local store instead)."""
        return CheckpointStore(uri, storage_options, run_id=run_id)

    def _make_persister(self, store: CheckpointStore, plan_caching: bool) -> Any:
        """The persist step (the tiered checkpointer's writes every rank's own local generation)."""
        return DcpPersister(
            store,
            process_group=self.process_group,
            rank=self.rank,
            thread_count=self.thread_count,
            write_retry=self.write_retry,
            plan_key=new_cache_key() if plan_caching and plan_caching_available() else None,
        )

    def _make_target(self, store: CheckpointStore) -> Any:
        """Where each commit goes next (``None``: ``store``'s retention; the tiered checkpointer's local tier)."""
        return None

    def close(self, timeout: float | None = None, *, abandon: bool = False) -> None:
        """Drain (bounded by ``timeout``), stop the threads and release the gloo group created here; idempotent.

        Raises:
            ShardedSaveError: A save failed and its error was not raised yet.
        """
        if self.closed:
            return
        try:
            super().close(timeout, abandon=abandon)
        finally:
            # A save left to its thread (abandoned) may still be inside DCP's collectives on this group.
            if self._own_group and not self.abandoning.is_set() and dist.is_initialized():
                dist.destroy_process_group(self.process_group)
            self._own_group = False
