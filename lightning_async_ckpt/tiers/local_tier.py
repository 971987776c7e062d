"""The local tier of sharded (DCP) generations: every rank a self-contained generation in its own node-local store.

A node-local folder is visible to its node only, so a rank must be able to restore from its own local objects
alone. DCP by default writes each replicated item once (dedup to one rank) and one global ``.metadata``: another
node's rank would lack those items. Here, on the local tier only:

- :class:`LocalSavePlanner` builds DCP's global plan and metadata from the de-duplicated plans (valid, reshardable
  metadata), but hands every rank its full local plan back: a rank writes every item it holds, replicated ones too.
- Every rank writes into **its own** store (:func:`rank_store`: ``<local_dirpath>/rank-<r>``), under its own step
  claim (:class:`LocalTierWriter`), so ranks sharing one node-local folder and ranks with a folder each work alike.
- After DCP's save returned (the coordinator's ``finish`` only captured the global metadata), the global metadata is
  broadcast, and every rank writes a **per-rank** ``.metadata`` (the global one with ``storage_data`` replaced by
  this rank's own write results: its load reads only its own files) and commits its own manifest last. The
  coordinator also keeps the global metadata (:data:`GLOBAL_METADATA_NAME`), which promotion rewrites into the
  durable generation's ``.metadata`` (:mod:`.promote_dcp`).
- The ranks then agree (an all-reduce) whether every rank committed; if one did not, the save fails on every rank
  (a rank that committed keeps an orphan that resume ignores: a step counts only when every rank holds it).

Call sequence of :meth:`LocalTierPersister.persist` (on the engine's upload thread, the checkpoint group)::

    dcp.save(planner=LocalSavePlanner, writer=LocalTierWriter) -> broadcast(global metadata) ->
    per rank: record objects, .metadata (per rank), [global.metadata], manifest last -> all_reduce(MIN ok)
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.stream_persister import PersistWork
from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.sharded.commit import DCP_FORMAT
from lightning_async_ckpt.sharded.dcp_writer import (
    METADATA_NAME,
    AttemptPrefix,
    RankObjects,
    StoreStorageWriter,
    below_prefix,
)
from lightning_async_ckpt.sharded.handle import ShardedSaveError
from lightning_async_ckpt.sharded.persister import DcpPersister
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import from_first

__all__ = [
    "GLOBAL_METADATA_NAME",
    "LOCAL_TIER_KEY",
    "LocalSavePlanner",
    "LocalTierPersister",
    "LocalTierWriter",
    "rank_store",
]

_log = logging.getLogger(__name__)

#: The coordinator's copy of DCP's global metadata in its local generation (promotion's source for ``.metadata``).
GLOBAL_METADATA_NAME = "global.metadata"
#: ``Manifest.extra`` key of a local-tier generation: ``{"rank": r, "world_size": W}``.
LOCAL_TIER_KEY = "local_tier"


def rank_store(local_dirpath: str, rank: int, *, run_id: str | None = None) -> CheckpointStore:
    """Rank ``rank``'s local store: ``<local_dirpath>/rank-<rank>`` (one writer per store, shared folder or not)."""
    return CheckpointStore(f"{local_dirpath.rstrip('/')}/rank-{rank}", run_id=run_id)


class LocalSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that every rank writes every item it holds (no de-duplication).

    The global metadata is built from the plans de-duplicated to the lowest rank (so it is valid: no overlapping
    chunks, and a replicated item is rank 0's copy, as a single writer's checkpoint under DDP holds rank 0's
    buffers), and each rank gets back its de-duplicated plan plus the replicated items DCP dropped from it. Write results of a
    replicated item from two ranks share one ``MetadataIndex`` (its hint is not compared), so each rank's own
    results address its own copy.
    """

    def __init__(self) -> None:
        super().__init__(dedup_save_to_lowest_rank=True, enable_plan_caching=False)
        #: Which rank's copy of each item the global metadata names: the one DCP's de-duplication kept.
        self.owner: dict[Any, int] = {}

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The de-duplicated global plan's metadata, with every rank's dropped items given back to it."""
        planned, metadata = super().create_global_plan(all_plans)
        full = []
        for rank, (original, plan) in enumerate(zip(all_plans, planned, strict=True)):
            kept = {item.index for item in plan.items}
            self.owner.update(dict.fromkeys(kept, rank))
            dropped = [item for item in original.items if item.index not in kept]
            full.append(dataclasses.replace(plan, items=[*plan.items, *dropped]))
        self.global_plan = full
        return full, metadata


class LocalTierWriter(StoreStorageWriter):
    """A DCP storage writer of one rank's local generation: every rank claims and commits its own store.

    The coordinator's ``finish`` writes nothing: it keeps the global metadata (:attr:`global_metadata`); the
    persister commits every rank's generation after DCP's save returned.
    """

    def __init__(self, store: CheckpointStore, step: int, *, planner: LocalSavePlanner, **kwargs: Any) -> None:
        super().__init__(store, step, **kwargs)
        self.planner = planner
        self.global_metadata: Metadata | None = None
        self.own: list[WriteResult] = []

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Create this rank's generation folder and claim the step in this rank's store."""
        plan = super().prepare_local_plan(plan)
        self.claim = self.store.begin(self.step)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's file prefixes only: each rank's token and prefix come from its own claim."""
        return FileSystemWriter.prepare_global_plan(self, plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's files under its own claim's token (and prefix); keep its own write results."""
        if self.claim is None:
            raise StorageError(f"rank {self.rank} writes step {self.step} without a claim")
        prefix = self.claim.prefix + plan.storage_data.prefix
        plan = dataclasses.replace(plan, storage_data=AttemptPrefix(prefix, self.claim.token))
        out = super().write_data(plan, planner)
        self.own = [wr for wr in out.value() if not isinstance(wr.storage_data, RankObjects)]
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Keep the global metadata (every rank's files, paths relative to that rank's generation folder); a
        replicated item points at the copy DCP's de-duplication kept, as a plain DCP save would."""
        storage: dict[Any, Any] = {}
        owner = self.planner.owner
        for rank, written in enumerate(results):
            for wr in written:
                if not isinstance(wr.storage_data, RankObjects) and (
                    wr.index not in storage or owner.get(wr.index) == rank
                ):
                    storage[wr.index] = wr.storage_data
        self.global_metadata = dataclasses.replace(metadata, storage_data=storage)

    def commit_local(self, metadata: Metadata, *, rank: int, world_size: int, cut: dict[str, Any]) -> Manifest:
        """Write this rank's per-rank ``.metadata`` (and, on rank 0, the global one), then its manifest last."""
        claim = self.claim
        if claim is None:
            raise StorageError(f"rank {rank} has no claim on step {self.step}")
        prefix = claim.prefix
        own = {
            wr.index: dataclasses.replace(wr.storage_data, relative_path=below_prefix(prefix, wr))
            if prefix
            else wr.storage_data
            for wr in self.own
        }
        local = dataclasses.replace(metadata, storage_data=own)
        with self.fs._lock:
            objects = sorted(self.fs.objects.values(), key=lambda e: e.name)
        for entry in objects:
            claim.record(entry)
        claim.write_bytes(METADATA_NAME, pickle.dumps(local))
        if rank == 0:
            claim.write_bytes(GLOBAL_METADATA_NAME, pickle.dumps(metadata))
        return claim.commit(
            cut={**cut, "step": self.step, "world_size": world_size},
            extra={
                "format": DCP_FORMAT,
                "ranks": {str(rank): [entry.name for entry in objects]},
                "dcp_folder": prefix.rstrip("/"),
                LOCAL_TIER_KEY: {"rank": rank, "world_size": world_size},
            },
        )


class LocalTierPersister(DcpPersister):
    """The engine's persist step for the local tier of sharded generations (see the module docstring).

    Args:
        store: This rank's local store (:func:`rank_store`).
        process_group: The checkpoint group (``None``: one process).
        rank: This rank in ``process_group``.
        world_size: The group's size.
        thread_count: DCP's I/O threads per rank.
        write_retry: Retries of a throttled write.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        process_group: Any,
        rank: int,
        world_size: int,
        thread_count: int = 1,
        write_retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(
            store, process_group=process_group, rank=rank, thread_count=thread_count, write_retry=write_retry
        )
        self.world_size = world_size

    def persist(self, work: PersistWork) -> Manifest | None:
        """Save the staged state to this rank's local store; every rank commits or the save fails on every rank.

        Raises:
            ShardedSaveError: The save failed on some rank (raised on every rank).
        """
        planner = LocalSavePlanner()
        writer = LocalTierWriter(self.store, work.step, planner=planner, **self.writer_options(work))
        pg = self.process_group
        try:
            dcp.save(work.state, storage_writer=writer, planner=planner, process_group=pg, no_dist=pg is None)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP failed it on every rank
            writer.abort()
            raise self.save_error(work, exc, "local") from exc
        try:
            global_metadata = from_first(pg, writer.global_metadata)
        except Exception as exc:  # a dead peer: nothing committed here
            writer.abort()
            raise ShardedSaveError(f"local save of step {work.step} failed, not committed: {exc}") from exc
        manifest: Manifest | None = None
        failure: BaseException | None = None
        try:
            manifest = writer.commit_local(
                global_metadata, rank=self.rank, world_size=self.world_size, cut=dict(work.cut)
            )
        except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
            failure = exc
            writer.abort()
        ok = torch.tensor([0 if failure is not None else 1], dtype=torch.int32)
        try:
            if pg is not None:
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
        except Exception as exc:  # a dead peer: this rank's part may be committed, an orphan resume never uses
            raise ShardedSaveError(f"local commit of step {work.step}: the ranks could not agree: {exc}") from exc
        if int(ok.item()) == 0:
            where = f"rank {self.rank}: {type(failure).__name__}: {failure}" if failure else "on another rank"
            raise ShardedSaveError(f"local commit of step {work.step} failed {where}; the step is not committed")
        return manifest
