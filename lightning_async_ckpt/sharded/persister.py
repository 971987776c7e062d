"""The DCP persister: the engine's persist step when every rank writes its shards in torch DCP's format.

:meth:`DcpPersister.persist` is collective: a rank whose staging failed still enters ``dcp.save`` and fails it there,
so no peer waits; a failure on any rank fails the save on every rank as one
:class:`~lightning_async_ckpt.sharded.handle.ShardedSaveError` (``.torn`` when a guard refused it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.stream_persister import PersistWork
from lightning_async_ckpt.sharded.dcp_writer import RankObjects, StoreStorageWriter
from lightning_async_ckpt.sharded.handle import ShardedSaveError, describe_failure, is_torn
from lightning_async_ckpt.sharded.plan_cache import caching_planner
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["DCP_VIEWS", "DcpPersister"]

#: ``save(..., extra={DCP_VIEWS: [key, ...]})``: top-level keys that also get a DCP folder of their own
#: (:mod:`~lightning_async_ckpt.sharded.dcp_views`).
DCP_VIEWS = "dcp_views"

_log = logging.getLogger(__name__)


class DcpPersister:
    """Writes one generation as a DCP folder, every rank its own files, the coordinator the manifest last.

    Args:
        store: The store (the same root and run id on every rank).
        process_group: The group DCP's collectives run on (``None``: one process, no collectives).
        rank: This process's rank in ``process_group`` (rank 0 coordinates and runs retention).
        thread_count: DCP's I/O threads per rank.
        write_retry: Retries of a throttled object-store write (see :mod:`.write_retry`).
        plan_key: DCP plan-cache key (:mod:`.plan_cache`), or ``None`` to plan every save.
    """

    collective = True  # a rank whose staging failed fails the save inside DCP's collectives, on every rank

    def __init__(
        self,
        store: CheckpointStore,
        *,
        process_group: Any,
        rank: int,
        thread_count: int = 1,
        write_retry: RetryPolicy | None = None,
        plan_key: str | None = None,
    ) -> None:
        self.store = store
        self.process_group = process_group
        self.rank = rank
        self.coordinator = rank == 0
        self.thread_count = thread_count
        self.write_retry = write_retry
        self.plan_key = plan_key

    def persist(self, work: PersistWork) -> Manifest | None:
        """Run ``dcp.save`` of the staged state; returns the committed manifest (``None`` on a rank that could not
        read it back: the step is committed all the same).

        Raises:
            ShardedSaveError: The save failed on some rank (the same error on every rank).
        """
        writer = StoreStorageWriter(
            self.store, work.step, views=tuple(work.extra.get(DCP_VIEWS, ())), **self.writer_options(work)
        )
        try:
            dcp.save(
                work.state,
                storage_writer=writer,
                planner=caching_planner(self.plan_key) if self.plan_key else None,
                process_group=self.process_group,
                no_dist=self.process_group is None,
            )
            return writer.commit_result if writer.committed else self._read_manifest(work.step)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure fails this save on every rank
            writer.abort()
            raise self.save_error(work, exc, "sharded") from exc

    def writer_options(self, work: PersistWork) -> dict[str, Any]:
        """The storage writer's arguments every DCP save of ``work`` shares: the upload record and the staging checks."""
        job, record = work.job, work.record
        started = time.time()

        def staged_ok() -> None:
            # A rank whose staging failed still enters DCP's collectives and fails there: no peer waits for it.
            if job.error is not None:
                raise job.error

        def written(report: RankObjects) -> None:
            nbytes = sum(o.size for o in report.objects)
            record.bytes, record.upload_s = nbytes, time.time() - started
            record.mark("upload", started)
            work.uploaded(report, nbytes)

        return {
            "thread_count": self.thread_count,
            "on_written": written,
            "on_plan": staged_ok,
            "before_report": job.confirm,  # the guard's last word on this rank, before the coordinator may commit
            "objects": dict(work.objects) or None,
            "retry": self.write_retry,
        }

    @staticmethod
    def save_error(work: PersistWork, exc: BaseException, what: str) -> ShardedSaveError:
        """The error of a failed ``dcp.save`` of ``work`` (``.torn`` when a guard refused it)."""
        error = ShardedSaveError(f"{what} save of step {work.step} failed, not committed: {describe_failure(exc)}")
        error.torn = bool(work.job.torn_categories) or is_torn(exc)
        return error

    def _read_manifest(self, step: int) -> Manifest | None:
        # DCP's save returned on this rank: the coordinator's commit succeeded. A failing read-back must not make
        # this rank disagree with the others about the outcome.
        try:
            return self.store.manifest(step)
        except Exception:  # noqa: BLE001 - the step is committed; only this rank's copy of the manifest is missing
            _log.warning("step %s is committed but its manifest could not be read back here", step, exc_info=True)
            return None

    def close(self) -> None:
        """Nothing to release: the checkpointer owns the process group."""
