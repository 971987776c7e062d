"""Asynchronous sharded checkpoints for plain loops and raw FSDP2: fenced staging of local shards, ``dcp.save`` behind.

One save: on the training thread, the core capture plan classifies every local shard (a DTensor's local tensor,
or a plain tensor; :mod:`~lightning_async_ckpt.sharded.capture`); what is not proven safe to defer is copied at
the cut into pooled host buffers, the rest (parameters and optimizer state, when the caller passes the fences:
:meth:`ShardedCheckpointer.attach`) is copied on a background thread while forward and backward run, and the
training thread waits for it only at the fence (right before the next optimizer update). Then ``dcp.save`` runs
on the background thread with a :class:`~lightning_async_ckpt.sharded.dcp_writer.StoreStorageWriter`, over a
gloo process group created once for checkpoints, so DCP's plan exchange and commit gather never interleave with
the training's collectives. Every rank checks its guard before it reports its objects; the manifest is written
last by the coordinator (see :mod:`~lightning_async_ckpt.sharded.commit`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_async_ckpt.core.capture import Category, Fence
from lightning_async_ckpt.core.hooks import FenceHooks
from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.staging import BufferPool, StagingJob, resolve_budget
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.sharded.capture import LocalCapture, capture_local
from lightning_async_ckpt.sharded.dcp_writer import RankObjects, StoreStorageWriter
from lightning_async_ckpt.sharded.handle import ShardedSaveError, ShardedSaveHandle, describe_failure, is_torn
from lightning_async_ckpt.sharded.plan_cache import caching_planner, new_cache_key, plan_caching_available
from lightning_async_ckpt.storage.direct import release_buffers
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["ShardedCheckpointer", "ShardedSaveError", "ShardedSaveHandle"]

_log = logging.getLogger(__name__)


class ShardedCheckpointer:
    """Asynchronous DCP-format checkpoints of a sharded (or plain) state dict into a :class:`CheckpointStore`.

    Every rank constructs one (the constructor creates the gloo group: a collective call) and calls :meth:`save`
    at the same steps. One save is in flight at a time: the next ``save`` waits for the previous one, because the
    host buffers are reused. Local shards are copied at the cut unless the caller passes fences (:meth:`attach`
    for a plain loop, :meth:`declare_fences` plus :meth:`wait` for an integration) and the deferral proof holds;
    then parameters and optimizer state are staged while forward and backward run (see
    :mod:`~lightning_async_ckpt.sharded.capture`). A background failure is raised once, on the training thread, at the next ``save``
    or :meth:`drain`; every rank raises it (DCP agrees on failures across ranks).

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

    Raises:
        ConfigError: A bad argument.
    """

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
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError(f"thread_count must be an int >= 1, got {thread_count!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be None (keep everything) or an int >= 1, got {keep_last!r}")
        self.timeout_s = float(timeout_s)
        self.thread_count = thread_count
        self.keep_last = keep_last
        if write_retry is not None and not isinstance(write_retry, RetryPolicy):
            raise ConfigError(f"write_retry must be a RetryPolicy or None, got {write_retry!r}")
        self.write_retry = write_retry
        self._plan_key = new_cache_key() if plan_caching and plan_caching_available() else None
        self._own_group = False
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self._own_group = True
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        if isinstance(store, CheckpointStore):
            self.store = store
        else:
            if run_id is None and process_group is not None:
                # One run id on every rank: the coordinator's manifest names it, retention keys on it.
                ids = [CheckpointStore.new_run_id()]
                dist.broadcast_object_list(ids, src=dist.get_global_rank(process_group, 0), group=process_group)
                run_id = ids[0]
            self.store = CheckpointStore(store, storage_options, run_id=run_id)
        self.guard = guard
        StagingJob([], [], guard=guard)  # validates the guard mode now (ConfigError)
        self.pool = BufferPool(resolve_budget(host_memory_budget))
        self._fence_hooks = FenceHooks(lambda fence: self.wait(fence))
        self._modules: list[torch.nn.Module] = []
        self._optimizers: list[Any] = []
        self._demoted: set[Category] = set()
        self._capture: LocalCapture | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: ShardedSaveHandle | None = None
        self._error: BaseException | None = None
        self._closed = False

    def __enter__(self) -> ShardedCheckpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the body's exception wins; this one is logged
            _log.warning("closing the sharded checkpointer while unwinding failed", exc_info=True)

    # -- training thread -----------------------------------------------------------------------------------
    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
    ) -> None:
        """Plain loops: install the fences (forward pre-hook, optimizer step pre-hooks); remember what to classify.

        After this, :meth:`save` defers the shards of ``model``'s parameters and the optimizers' state (when the
        proof holds) and the hooks wait for them right before the next forward / optimizer update.
        """
        self._fence_hooks.attach(model, optimizer)
        self._modules = [model]
        self._optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)

    def detach(self) -> None:
        """Wait at every fence, then remove the hooks installed by :meth:`attach`."""
        self.wait(Fence.OPTIMIZER_STEP)
        self._fence_hooks.remove()

    def declare_fences(
        self, fences: Iterable[Fence], *, modules: Sequence[torch.nn.Module] = (), optimizers: Sequence[Any] = ()
    ) -> None:
        """Integrations: the fences the caller passes itself (calling :meth:`wait`), and the modules/optimizers."""
        self._fence_hooks.declare(fences)
        self._modules, self._optimizers = list(modules), list(optimizers)

    def wait(self, fence: Fence) -> float:
        """At ``fence`` (training thread): block until the save in flight staged what is fenced there.

        Returns:
            Seconds blocked.
        """
        capture = self._capture
        if capture is None:
            return 0.0
        waited = capture.job.wait(fence)
        if capture.job.done.is_set() and fence == Fence.OPTIMIZER_STEP:
            self._capture = None
        return waited

    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        modules: Sequence[torch.nn.Module] | None = None,
        optimizers: Sequence[Any] | None = None,
        defer: bool = True,
        objects: dict[str, bytes] | None = None,
    ) -> ShardedSaveHandle:
        """Capture the local shards at the cut and write generation ``step`` in the background.

        Args:
            step: The generation's step (a non-negative int, the same on every rank).
            state_dict: E.g. ``{"model": msd, "optim": osd}`` from
                ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``.
            modules: Modules whose parameters/buffers appear in ``state_dict`` (default: those of :meth:`attach`
                or :meth:`declare_fences`).
            optimizers: Optimizers whose state appears in ``state_dict`` (same default).
            defer: ``False`` copies every shard at the cut.
            objects: More objects this rank writes into the generation (name -> bytes, e.g. Lightning's
                ``meta.pt`` on rank 0), listed in the manifest like the DCP files.

        Returns:
            The save's handle; ``staged`` is resolved once the deferred shards are copied.

        Raises:
            ShardedSaveError: The previous save failed (raised once).
            ConfigError: A bad step, or the checkpointer is closed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if self._closed:
            raise ConfigError("this ShardedCheckpointer is closed; create a new one")
        start = time.perf_counter()
        self._wait_inflight(self.timeout_s * 2)
        self._raise_pending()
        handle = ShardedSaveHandle(step=step)
        with torch.no_grad():
            capture = capture_local(
                state_dict,
                modules=self._modules if modules is None else list(modules),
                optimizers=self._optimizers if optimizers is None else list(optimizers),
                fences=self._fence_hooks.fences,
                pool=self.pool,
                guard=self.guard,
                demoted=self._demoted,
                defer=defer,
            )
        handle._job = capture.job
        handle.deferred_bytes = capture.job.deferred_bytes
        handle.sync_bytes = capture.plan.total_bytes - handle.deferred_bytes
        if handle.deferred_bytes == 0:
            capture.job.run()  # nothing to copy: the fences open and the guard has nothing to check
            handle.staged.set_result(step)
            self._capture = None
        else:
            self._capture = capture
        handle.blocked_s = time.perf_counter() - start
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lightning_async_ckpt-sharded")
        self._inflight = handle
        self._executor.submit(self._persist, handle, capture, objects)
        return handle

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the save in flight; raise a background failure once.

        Args:
            timeout: Seconds to wait (default: twice the group timeout).

        Raises:
            ShardedSaveError: A save failed, or did not end within ``timeout``.
        """
        self._wait_inflight(self.timeout_s * 2 if timeout is None else timeout)
        self._raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Drain, stop the background thread and release the gloo group created here; idempotent."""
        if self._closed:
            return
        drained = False
        try:
            self.drain(timeout)
            drained = True
        finally:
            self._closed = True
            if self._executor is not None:
                # A save that outlived the bound is left to its thread (it writes no manifest without every rank):
                # waiting for it here would turn a bounded close into a hang.
                self._executor.shutdown(wait=drained, cancel_futures=not drained)
                self._executor = None
            self._fence_hooks.remove()
            self._capture = None
            self.pool.clear()
            release_buffers()
            if drained and self._own_group and dist.is_initialized():
                dist.destroy_process_group(self.process_group)
            self._own_group = False

    def _wait_inflight(self, timeout: float) -> None:
        handle = self._inflight
        if handle is None:
            return
        try:
            handle.committed.exception(timeout)
        except FutureTimeout:
            raise ShardedSaveError(
                f"the sharded save of step {handle.step} did not end within {timeout:.0f} s; a rank may be hung "
                "or dead (its collectives time out after the group timeout)"
            ) from None
        self._inflight = None

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    # -- background thread ---------------------------------------------------------------------------------
    def _persist(self, handle: ShardedSaveHandle, capture: LocalCapture, objects: dict[str, bytes] | None) -> None:
        job = capture.job
        if not job.done.is_set():
            job.run()  # the deferred shards, while the training thread runs forward and backward
            if job.error is None:
                handle.staged.set_result(handle.step)

        def staged_ok() -> None:
            # A rank whose staging failed still enters DCP's collectives and fails there: no peer waits for it.
            if job.error is not None:
                raise job.error

        def written(report: RankObjects) -> None:
            handle.uploaded.set_result(report)

        writer = StoreStorageWriter(
            self.store,
            handle.step,
            thread_count=self.thread_count,
            on_written=written,
            on_plan=staged_ok,
            before_report=job.confirm,  # the guard's last word on this rank, before the coordinator may commit
            objects=objects,
            retry=self.write_retry,
        )
        try:
            staged = capture.staged_state() if job.error is None else {}
            dcp.save(
                staged,
                storage_writer=writer,
                planner=caching_planner(self._plan_key) if self._plan_key else None,
                process_group=self.process_group,
                no_dist=self.process_group is None,
            )
            manifest = writer.commit_result if writer.committed else self._read_manifest(handle.step)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure fails this save, raised later
            writer.abort()
            self.pool.release(capture.buffers)
            if job.torn_categories:
                self._demoted |= job.torn_categories
            if not handle.staged.done():
                handle.staged.set_exception(job.error or exc)
            error = ShardedSaveError(
                f"sharded save of step {handle.step} failed, not committed: {describe_failure(exc)}"
            )
            error.__cause__ = exc
            error.torn = bool(job.torn_categories) or is_torn(exc)
            if not handle.uploaded.done():
                handle.uploaded.set_exception(error)
            self._error = error
            handle.committed.set_exception(error)
            return
        self.pool.release(capture.buffers)  # before the futures resolve: the next cut finds them free
        if self.keep_last is not None and self.rank == 0:
            try:
                self.store.gc(self.keep_last)
            except Exception:  # noqa: BLE001 - retention failing never fails the committed save
                _log.warning("retention after the commit of step %s failed", handle.step, exc_info=True)
        handle.committed.set_result(manifest)

    def _read_manifest(self, step: int) -> Manifest | None:
        # DCP's save returned on this rank: the coordinator's commit succeeded. A failing read-back must not make
        # this rank disagree with the others about the outcome.
        try:
            return self.store.manifest(step)
        except Exception:  # noqa: BLE001 - the step is committed; only this rank's copy of the manifest is missing
            _log.warning("step %s is committed but its manifest could not be read back here", step, exc_info=True)
            return None
