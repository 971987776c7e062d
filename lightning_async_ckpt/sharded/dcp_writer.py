"""A torch DCP ``StorageWriter`` that writes one generation of a :class:`CheckpointStore`, checksumming as it goes.

The format is DCP's own. Every data file is created exclusively under its DCP name with the attempt's token
appended (``__1_0.distcp.<token>``) and ``.metadata`` is published exclusively, so a stalled rank of an earlier
attempt never writes a committed object. Each rank's objects travel to the coordinator inside DCP's own gather of
write results; ``finish`` (coordinator, only when every rank succeeded) writes ``.metadata``, then the manifest
last. If a rank fails, DCP raises on every rank and no manifest is written: call :meth:`abort` then.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.sharded.commit import RankObjects, commit_generation
from lightning_async_ckpt.sharded.dcp_files import StoreFileSystem
from lightning_async_ckpt.sharded.dcp_views import metadata_view
from lightning_async_ckpt.sharded.write_retry import WriteRetries
from lightning_async_ckpt.storage.claims import Lease, attempt_claim_name
from lightning_async_ckpt.storage.manifest import validate_object_name

if TYPE_CHECKING:
    from lightning_async_ckpt.core.persist import RetryPolicy
    from lightning_async_ckpt.storage.store import CheckpointStore
    from lightning_async_ckpt.storage.writer import GenerationWriter

__all__ = ["METADATA_NAME", "REPORT_FQN", "RankObjects", "StoreStorageWriter", "planned_bytes"]

#: DCP's metadata file name inside a generation.
METADATA_NAME = ".metadata"
#: The fully qualified name of the per-rank report results (never written into DCP's metadata).
REPORT_FQN = "__lightning_async_ckpt_rank_objects__"


@dataclass(frozen=True)
class AttemptPrefix:
    """The coordinator's plan for one rank: DCP's file-name prefix, and the attempt's token."""

    prefix: str
    token: str


def below_prefix(prefix: str, result: WriteResult) -> str:
    """A data file's path relative to the prefix folder (a spread file: one more level up, out of the folder)."""
    relative = result.storage_data.relative_path
    return "../" * prefix.count("/") + relative if relative.startswith("../") else relative.removeprefix(prefix)


def planned_bytes(plan: SavePlan) -> int:
    """The tensor bytes a rank's plan writes (byte items count 0): an estimate of its data files' sizes."""
    total = 0
    for item in plan.items:
        data = item.tensor_data
        if data is not None:
            total += math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    return total


class StoreStorageWriter(FileSystemWriter):
    """DCP ``StorageWriter`` for one generation (``<root>/step-XXXXXXXX/``) of a store; one instance per save.

    Reuses DCP's ``FileSystemWriter`` through a file system that writes with the store's backend and checksums every
    object. Not thread-safe: DCP's ``save`` drives one instance from one thread.

    Args:
        store: The store; its ``root`` holds the generation.
        step: The generation's step.
        thread_count: DCP's I/O threads per rank.
        on_written: Called on every rank with this rank's :class:`RankObjects` once its objects are durable
            (before the commit): resolves a handle's ``uploaded`` future.
        on_commit: Called on the coordinator in ``finish`` with ``(claim, objects of every rank)`` after DCP's
            ``.metadata`` is durable; writes the manifest (default:
            :func:`~lightning_async_ckpt.sharded.commit.commit_generation`).
        objects: More objects this rank writes into the generation beside DCP's files (name -> bytes, e.g.
            Lightning's ``meta.pt``), durable and reported like its data files, so the manifest lists them.
            Names must be unique across ranks and must not be DCP's own (``__*``, ``.metadata``).
        on_plan: Called on every rank before its local plan is accepted; raising fails the save on every rank
            (e.g. this rank's staging failed).
        before_report: Called on every rank after its objects are durable and before they are reported to the
            coordinator; raising fails the save on every rank (e.g. the guard found a torn copy).
        retry: Retries of a throttled write (503 SlowDown, 429, a reset connection): this rank's DCP data files
            are written again from the start, each extra object alone (default
            :data:`~lightning_async_ckpt.sharded.write_retry.DEFAULT_WRITE_RETRY`).
        views: Top-level keys of the state that also get a DCP checkpoint folder of their own, ``<key>/.metadata``
            over the same data files (:mod:`.dcp_views`; e.g. accelerate's ``pytorch_model_fsdp_0``), written by
            the coordinator after ``.metadata`` and listed in the manifest (``extra["dcp_views"]``).

    Raises:
        StorageError: An extra object name is DCP's own or not a valid object name.
    """

    def __init__(
        self,
        store: CheckpointStore,
        step: int,
        *,
        thread_count: int = 1,
        on_written: Callable[[RankObjects], None] | None = None,
        on_commit: Callable[[GenerationWriter, list[RankObjects]], Any] | None = None,
        objects: Mapping[str, bytes] | None = None,
        on_plan: Callable[[], None] | None = None,
        before_report: Callable[[], None] | None = None,
        retry: RetryPolicy | None = None,
        views: tuple[str, ...] = (),
    ) -> None:
        for name in objects or {}:
            if name.startswith("__") or name == METADATA_NAME or "/" in validate_object_name(name):
                raise StorageError(f"extra object name {name!r} is DCP's own or not a plain file name")
        self._objects = dict(objects or {})
        path = store.generation_path(step)
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=thread_count)
        self.fs = StoreFileSystem(store, path)
        self.path = path
        self.store = store
        self.step = step
        self.claim: GenerationWriter | None = None
        self.commit_result: Any = None
        self.committed = False
        self._on_written = on_written
        self._on_commit = on_commit
        self._on_plan = on_plan
        self._before_report = before_report
        self._retries = WriteRetries(retry)
        self._views = tuple(views)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a save (DCP step 0); the location is fixed by the store and step."""
        if checkpoint_id is not None and str(checkpoint_id) != self.path:
            raise StorageError(f"this writer writes {self.path!r}; it cannot write checkpoint_id {checkpoint_id!r}")
        super().reset(None)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Create the generation folder (DCP step 1); whether the step may be written is decided by the claim."""
        if self._on_plan is not None:
            self._on_plan()
        self.fs.mkdir(self.path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Claim the step on the coordinator (DCP step 2): a committed step is refused.

        When another writer holds the step's claim, every rank writes below this attempt's prefix (the plan tells each
        rank), ``.metadata`` included; the first manifest wins, as for single-writer generations.
        """
        self.claim = self.store.begin(self.step)
        planned = super().prepare_global_plan(plans)
        token, prefix = self.claim.token, self.claim.prefix
        return [
            dataclasses.replace(plan, storage_data=AttemptPrefix(prefix + plan.storage_data.prefix, token))
            for plan in planned
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's objects (DCP step 3) and append this rank's object report to its results.

        A rank other than the coordinator holds its own attempt claim while it writes (the coordinator's is its
        step claim's lease); every name it writes carries the attempt's token.
        """
        rank = self.rank if self.rank is not None else 0
        storage = plan.storage_data
        self.fs.token = storage.token
        self.fs.data_size = -(-planned_bytes(plan) // max(1, self.thread_count))  # parts sized from it (S3)
        subfolder = storage.prefix.rpartition("/")[0]
        folder = self.fs.concat_path(self.path, subfolder) if subfolder else self.path
        lease = None
        if self.claim is not None:
            self.fs.lease = self.claim.lease
        else:
            self.fs.tokened = set(self._objects)
            name = attempt_claim_name(storage.token, rank)
            lease = self.fs.lease = Lease(self.store, self.fs.concat_path(folder, name), self.step, storage.token, rank)
            lease.create()
        try:
            results = self._retried(lambda: super(StoreStorageWriter, self).write_data(plan, planner).value(), rank)
            results = [self._located(wr) for wr in results]
            for name, data in self._objects.items():
                self._retried(lambda name=name, data=data: self._write_object(folder, name, data), rank, name)
        finally:
            if lease is not None:
                lease.release()  # this rank's part of the attempt ended: it writes nothing more
        with self.fs._lock:
            objects = tuple(sorted(self.fs.objects.values(), key=lambda e: e.name))
        report = RankObjects(rank=rank, objects=objects, retries=self._retries.count)
        if self._before_report is not None:
            self._before_report()
        if self._on_written is not None:
            self._on_written(report)
        index = MetadataIndex(fqn=f"{REPORT_FQN}{report.rank}")
        out: Future[list[WriteResult]] = Future()
        out.set_result([*results, WriteResult(index=index, size_in_bytes=0, storage_data=report)])
        return out

    def _retried(self, write: Callable[[], Any], rank: int, name: str | None = None) -> Any:
        """Run ``write`` with retries on throttling; a failed attempt's objects are removed before the next."""
        keep = self.fs.created()
        who = "the coordinator" if rank < 0 else f"rank {rank}"
        what = f"{who}'s {'object ' + repr(name) if name else 'data files'} of step {self.step}"
        return self._retries.run(write, undo=lambda: self.fs.undo(keep), what=what)

    def _write_object(self, folder: str, name: str, data: bytes) -> None:
        path = self.fs.concat_path(folder, name)
        self.fs.sizes[path] = len(data)
        with self.fs.create_stream(path, "wb") as stream:
            stream.write(data)

    def _located(self, result: WriteResult) -> WriteResult:
        """DCP's write result with the file it really went to (the token appended), for ``.metadata``."""
        info = result.storage_data
        if not hasattr(info, "relative_path"):
            return result
        located = self.fs.physical(info.relative_path)
        return dataclasses.replace(result, storage_data=dataclasses.replace(info, relative_path=located))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write DCP's ``.metadata``, then commit the manifest listing every rank's objects (DCP step 4)."""
        reports = [wr.storage_data for rank in results for wr in rank if isinstance(wr.storage_data, RankObjects)]
        plain = [[wr for wr in rank if not isinstance(wr.storage_data, RankObjects)] for rank in results]
        if len(reports) != len(results):
            raise StorageError(f"{len(results)} ranks wrote but only {len(reports)} reported their objects")
        prefix = self.claim.prefix if self.claim is not None else ""
        if prefix:
            # This writer's DCP checkpoint is the prefix folder: its file paths relative to it, .metadata in it.
            plain = [
                [
                    dataclasses.replace(
                        wr, storage_data=dataclasses.replace(wr.storage_data, relative_path=below_prefix(prefix, wr))
                    )
                    for wr in rank
                ]
                for rank in plain
            ]
        path = self.path
        self.path = self.fs.concat_path(path, prefix.rstrip("/")) if prefix else path
        try:
            # A throttled .metadata write is written again from the start (its exclusive publish, and the
            # manifest's, retry inside the backend: storage.throttling), never replacing another attempt's.
            self._retried(lambda: super(StoreStorageWriter, self).finish(metadata, plain), -1, METADATA_NAME)
        finally:
            self.path = path
        entries = [self.fs.objects.pop(METADATA_NAME)]
        for key in self._views:
            view, moved = metadata_view(metadata, plain, key)
            self.path = self.fs.concat_path(path, f"{prefix}{key}")
            try:
                self._retried(lambda v=view, m=moved: super(StoreStorageWriter, self).finish(v, m), -1, METADATA_NAME)
            finally:
                self.path = path
            entry = self.fs.objects.pop(METADATA_NAME)
            name = f"{key}/{METADATA_NAME}"
            entries.append(dataclasses.replace(entry, name=name, path=entry.path if entry.path != name else None))
        self.fs.objects.update((e.name, e) for e in entries)
        reports.append(RankObjects(rank=-1, objects=tuple(entries)))
        if self.claim is None:
            raise StorageError("finish() ran on a rank that did not claim the step (not the coordinator)")
        if self._on_commit is None:
            extra = {"dcp_views": list(self._views)} if self._views else None
            self.commit_result = commit_generation(self.claim, reports, extra=extra)
        else:
            self.commit_result = self._on_commit(self.claim, reports)
        self.committed = True

    def abort(self) -> None:
        """Release the claim after a failed save (idempotent); data objects left behind are never trusted."""
        if self.claim is not None and not self.committed:
            self.claim.abort()
