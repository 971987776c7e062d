"""A torch DCP ``StorageWriter`` that writes one generation of a :class:`CheckpointStore`, checksumming as it goes.

The format is DCP's own: every rank writes ``__<rank>_<n>.distcp`` data files, the coordinator writes
``.metadata``; ``torch.distributed.checkpoint.load`` and ``dcp_to_torch_save`` read the folder at any world size.
On top of DCP, each object's size and checksum are computed as its bytes pass, and each rank's list of objects
travels to the coordinator inside DCP's own gather of write results (one extra :class:`WriteResult` per rank,
removed again before DCP's metadata is written), so the commit needs no collective of its own.

Call sequence (DCP's ``save`` drives it; steps as in DCP's ``StorageWriter`` docstring):

0. ``reset`` / ``set_up_storage_writer`` on every rank;
1. ``prepare_local_plan`` on every rank: the generation folder exists;
2. ``prepare_global_plan`` on the coordinator: the step is claimed in the store (refused if already committed);
3. ``write_data`` on every rank: data objects written, durable (``Backend.finish``), and reported;
4. ``finish`` on the coordinator, only when every rank's ``write_data`` succeeded: ``.metadata``, then
   ``manifest.json`` last (:func:`~lightning_async_ckpt.sharded.commit.commit_generation`).

If a rank fails, DCP raises on every rank and ``finish`` never runs: no manifest. Call :meth:`abort` then.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.storage.io import Checksum, WriteOnlyStream, fsync_dir
from lightning_async_ckpt.storage.manifest import ObjectEntry, validate_object_name

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.store import CheckpointStore
    from lightning_async_ckpt.storage.writer import GenerationWriter

__all__ = ["METADATA_NAME", "REPORT_FQN", "RankObjects", "StoreStorageWriter"]

#: DCP's metadata file name inside a generation.
METADATA_NAME = ".metadata"
#: The fully qualified name of the per-rank report results (never written into DCP's metadata).
REPORT_FQN = "__lightning_async_ckpt_rank_objects__"


@dataclass(frozen=True, kw_only=True)
class RankObjects:
    """What one rank wrote into a generation: sent to the coordinator inside DCP's gather of write results.

    Attributes:
        rank: The rank in the checkpoint's process group.
        objects: The rank's data objects with sizes and checksums.
    """

    rank: int
    objects: tuple[ObjectEntry, ...]


class _ChecksumStream(WriteOnlyStream):
    """Write-only stream over a backend object: counts and checksums bytes; closing is left to the file system."""

    def __init__(self, raw: IO[bytes], algorithm: str) -> None:
        self.raw = raw
        self.digest = Checksum(algorithm)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.digest.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        # The backend flushes and syncs once at the end; a direct-I/O file must not flush its tail early.
        pass

    def close(self) -> None:
        # DCP closes the stream inside its ``with``; the file system makes it durable after the block.
        pass


class _StoreFileSystem(FileSystemBase):
    """DCP's file-system seam over a store's fsspec filesystem and backend; records every object written."""

    def __init__(self, store: CheckpointStore, generation: str) -> None:
        self.store = store
        self.generation = generation.rstrip("/")
        self.objects: dict[str, ObjectEntry] = {}
        self._lock = threading.Lock()

    def _entry(self, path: str, size: int, checksum: str) -> ObjectEntry:
        # Relative to the generation folder: a writer under another writer's claim writes below its own prefix.
        rel = path[len(self.generation) + 1 :] if path.startswith(self.generation + "/") else path.rsplit("/", 1)[-1]
        name = validate_object_name(rel.rsplit("/", 1)[-1])
        return ObjectEntry(name=name, size=size, checksum=checksum, path=rel if rel != name else None)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = str(path)
        if "w" not in mode:
            with self.store.fs.open(path, mode) as f:
                yield f
            return
        entry = self._entry(path, 0, "")
        backend = self.store.backend
        try:
            raw = backend.open_write(path, direct_io=self.store.direct_io, subfolder=entry.path is not None)
        except Exception as exc:
            raise StorageError(f"could not open {path!r} for writing: {exc}") from exc
        stream = _ChecksumStream(raw, self.store.checksum)
        try:
            yield stream
        except BaseException:
            backend.discard(raw)
            raise
        try:
            backend.finish(raw)
        except Exception as exc:
            raise StorageError(f"could not finish {path!r}: {exc}") from exc
        with self._lock:
            self.objects[entry.name] = self._entry(path, stream.size, stream.digest.hexdigest())

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        path, new_path = str(path), str(new_path)
        if self.store.is_local:
            os.replace(path, new_path)
            fsync_dir(os.path.dirname(new_path))
        else:
            self.store.fs.mv(path, new_path)
        old = path.rsplit("/", 1)[-1]
        with self._lock:
            entry = self.objects.pop(old)
            renamed = self._entry(new_path, entry.size, entry.checksum)
            self.objects[renamed.name] = renamed

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.store.backend.prepare_folder(str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.store.fs.exists(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.store.fs.rm_file(str(path))


class StoreStorageWriter(FileSystemWriter):
    """DCP ``StorageWriter`` for one generation (``<root>/step-XXXXXXXX/``) of a store; one instance per save.

    Reuses DCP's ``FileSystemWriter`` for planning, file layout and serialization, through a file system that
    writes with the store's backend (``O_DIRECT`` and fsync on local disks, multipart uploads on S3) and
    checksums every object. Not thread-safe: DCP's ``save`` drives one instance from one thread.

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
    ) -> None:
        for name in objects or {}:
            if name.startswith("__") or name == METADATA_NAME or "/" in validate_object_name(name):
                raise StorageError(f"extra object name {name!r} is DCP's own or not a plain file name")
        self._objects = dict(objects or {})
        path = store.generation_path(step)
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=thread_count)
        self.fs = _StoreFileSystem(store, path)
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

        When another writer holds the step's claim (a live writer, or a crashed one that is not provably gone),
        the claim comes with a prefix: every rank then writes its files below it (the plan tells each rank), and
        DCP's ``.metadata`` goes there too, so the two writers never touch each other's files; the first manifest
        wins, as for single-writer generations.
        """
        self.claim = self.store.begin(self.step)
        planned = super().prepare_global_plan(plans)
        if not self.claim.prefix:
            return planned
        return [
            dataclasses.replace(
                plan,
                storage_data=dataclasses.replace(
                    plan.storage_data, prefix=self.claim.prefix + plan.storage_data.prefix
                ),
            )
            for plan in planned
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's objects (DCP step 3) and append this rank's object report to its results."""
        results = super().write_data(plan, planner).value()
        folder = self.fs.concat_path(self.path, plan.storage_data.prefix.rpartition("/")[0])
        for name, data in self._objects.items():
            with self.fs.create_stream(self.fs.concat_path(folder, name), "wb") as stream:
                stream.write(data)
        with self.fs._lock:
            objects = tuple(sorted(self.fs.objects.values(), key=lambda e: e.name))
        report = RankObjects(rank=self.rank if self.rank is not None else 0, objects=objects)
        if self._before_report is not None:
            self._before_report()
        if self._on_written is not None:
            self._on_written(report)
        index = MetadataIndex(fqn=f"{REPORT_FQN}{report.rank}")
        out: Future[list[WriteResult]] = Future()
        out.set_result([*results, WriteResult(index=index, size_in_bytes=0, storage_data=report)])
        return out

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
                        wr,
                        storage_data=dataclasses.replace(
                            wr.storage_data, relative_path=wr.storage_data.relative_path.removeprefix(prefix)
                        ),
                    )
                    for wr in rank
                ]
                for rank in plain
            ]
        path = self.path
        self.path = self.fs.concat_path(path, prefix.rstrip("/")) if prefix else path
        try:
            super().finish(metadata, plain)
        finally:
            self.path = path
        entry = self.fs.objects[METADATA_NAME]
        reports.append(RankObjects(rank=-1, objects=(entry,)))
        if self.claim is None:
            raise StorageError("finish() ran on a rank that did not claim the step (not the coordinator)")
        if self._on_commit is None:
            from lightning_async_ckpt.sharded.commit import commit_generation

            self.commit_result = commit_generation(self.claim, reports)
        else:
            self.commit_result = self._on_commit(self.claim, reports)
        self.committed = True

    def abort(self) -> None:
        """Release the claim after a failed save (idempotent); data objects left behind are never trusted."""
        if self.claim is not None and not self.committed:
            self.claim.abort()
