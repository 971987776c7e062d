"""Hook-path generations: the folders passed to ``accelerator.save_state``, as a store, writer and save.

``_FolderStore`` derives from ``CheckpointStore`` only because the engine accepts that type: it overrides every
method the engine calls, and its base-class root is never read or written.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import threading
import time
import zipfile
from dataclasses import dataclass, field
from typing import IO, Any

from lightning_async_ckpt.accelerate._layout import _ARCHIVE_RE, INCOMPLETE_MARKER, _log
from lightning_async_ckpt.core.engine import SaveHandle
from lightning_async_ckpt.errors import CheckpointError, GenerationExistsError, ManifestError, StorageError
from lightning_async_ckpt.storage.io import (
    Checksum,
    ChecksumWriter,
    exclusive_local_write,
    file_identity,
    fsync_dir,
    open_local_write,
    same_file,
)
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest, ObjectEntry, validate_object_name
from lightning_async_ckpt.storage.store import CheckpointStore

_READ_CHUNK = 8 << 20


@dataclass(eq=False)
class _FolderSave:
    """One hook-path save: the folder, and whether accelerate's synchronous part is known to have finished."""

    folder: str
    step: int
    expected: set[str]
    settled: threading.Event = field(default_factory=threading.Event)
    listing: list[str] = field(default_factory=list)
    abandoned: bool = False
    handle: SaveHandle | None = None

    def settle(self) -> None:
        """Record the files present now (accelerate's part is done) and release the commit."""
        names = []
        for dirpath, _, files in os.walk(self.folder):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), self.folder).replace(os.sep, "/")
                if rel in (MANIFEST_NAME, INCOMPLETE_MARKER) or rel.startswith(f".{MANIFEST_NAME}.tmp-"):
                    continue
                try:
                    names.append(validate_object_name(rel))
                except ManifestError:
                    _log.warning("not listing %s in the manifest of %s: unusual name", rel, self.folder)
        self.listing = sorted(names)
        self.settled.set()

    def abandon(self) -> None:
        """Never commit this folder (its save was not confirmed on every process)."""
        self.abandoned = True
        self.settled.set()


class _FolderStream(ChecksumWriter):
    """One of our objects in the folder: checksummed as it is written, fsynced and recorded on close."""

    def __init__(self, writer: _FolderWriter, name: str, raw: IO[bytes]) -> None:
        super().__init__(raw, writer.checksum)
        self._writer, self.name = writer, name
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self.raw.write(view)
        except Exception as exc:
            raise StorageError(f"could not write {self.name!r} into {self._writer.path}: {exc}") from exc
        return self.count(view)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.raw.flush()
            os.fsync(self.raw.fileno())
            self.raw.close()
        except Exception as exc:
            raise StorageError(f"could not finish {self.name!r} in {self._writer.path}: {exc}") from exc
        self._writer._record(ObjectEntry(name=self.name, size=self.size, checksum=self.checksum))

    def __enter__(self) -> _FolderStream:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self.closed:
            self.closed = True
            self.raw.close()


class _FolderWriter:
    """Writes our objects into accelerate's folder; commit waits for accelerate's part, then seals its files.

    Call sequence (the engine's): ``open(name)`` for each of our objects, then ``commit(...)``, or ``abort()``.

    The folder's names are fixed (accelerate loads them by name), so objects are written once another way: an
    existing file is unlinked and the name created exclusively, so an earlier save still holding a descriptor
    (a stalled writer) writes to an orphaned inode; the commit refuses when one of our objects is no longer
    the file this writer created, and the manifest is published exclusively, never replacing one.
    """

    def __init__(self, store: _FolderStore, save: _FolderSave) -> None:
        self.store = store
        self.step = save.step
        self.checksum = store.checksum
        self.path = save.folder
        self._save = save
        self._objects: dict[str, ObjectEntry] = {}
        self._own: set[str] = set()
        self._idents: dict[str, tuple[int, int] | None] = {}
        self._done = False

    def open(self, name: str) -> _FolderStream:
        """Open our object ``name`` in the folder for streaming writes."""
        if self._done:
            raise CheckpointError(f"{self.path}: this save is already committed or aborted")
        validate_object_name(name)
        if name in self._own:
            raise CheckpointError(f"object {name!r} was already written into {self.path}")
        path = os.path.join(self.path, *name.split("/"))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # an earlier save's object: its descriptor, if still open, keeps the old inode
            raw = open_local_write(path, self.store.direct_io)
        except OSError as exc:
            raise StorageError(f"could not open {path!r} for writing: {exc}") from exc
        self._own.add(name)
        self._idents[name] = file_identity(raw)
        return _FolderStream(self, name, raw)  # type: ignore[arg-type]

    def write_bytes(self, name: str, data: bytes) -> ObjectEntry:
        """Write a small object in one call and return its entry."""
        with self.open(name) as stream:
            stream.write(data)
        return self._objects[name]

    @property
    def objects(self) -> tuple[ObjectEntry, ...]:
        """Entries of our objects closed so far."""
        return tuple(self._objects.values())

    def commit(self, **kwargs: Any) -> Manifest:
        """Wait for accelerate's part, seal its files, write the manifest last, then drop the incomplete marker."""
        save = self._save
        save.settled.wait()
        if self._done:
            raise CheckpointError(f"{self.path}: this save is already committed or aborted")
        if save.abandoned:
            raise CheckpointError(
                f"{save.folder}: save_state was never confirmed finished on every process (close() was not "
                "called); the folder stays uncommitted"
            )
        missing = sorted(save.expected - set(save.listing))
        if missing:
            raise CheckpointError(f"accelerate did not write {missing} into {save.folder}; it stays uncommitted")
        replaced = sorted(name for name in self._objects if not self._mine(name))
        if replaced:
            raise CheckpointError(
                f"{save.folder}: {replaced} were replaced by another save since this one wrote them; it stays "
                "uncommitted"
            )
        for name in save.listing:
            if name not in self._own:
                self._record(self._seal(name))
        manifest = Manifest(
            step=self.step,
            run_id=self.store.run_id,
            objects=tuple(self._objects.values()),
            cut=dict(kwargs.get("cut") or {}),
            versions=_versions(),
            plan=dict(kwargs.get("plan") or {}),
            timings=dict(kwargs.get("timings") or {}),
            extra=dict(kwargs.get("extra") or {}),
            committed_at=time.time(),
        )
        try:
            fsync_dir(save.folder)
            exclusive_local_write(os.path.join(save.folder, MANIFEST_NAME), manifest.to_json())
            fsync_dir(os.path.dirname(save.folder) or ".")  # the folder's own entry
        except FileExistsError as exc:
            raise CheckpointError(
                f"{save.folder} was committed by another save meanwhile; this one is not committed"
            ) from exc
        except OSError as exc:
            raise StorageError(f"could not write the manifest of {save.folder}: {exc}") from exc
        self._done = True
        self.store.end_write(self.step)
        marker = os.path.join(save.folder, INCOMPLETE_MARKER)
        if os.path.exists(marker):
            os.unlink(marker)
            fsync_dir(save.folder)
        return manifest

    def abort(self) -> None:
        """Remove our own objects (accelerate's files are not ours to delete); the folder stays uncommitted."""
        if self._done:
            return
        self._done = True
        for name in self._own:
            if not self._mine(name):
                continue  # a later save's object at the same name: ours was orphaned
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, *name.split("/")))
        self.store.end_write(self.step)

    def _mine(self, name: str) -> bool:
        """Whether our object ``name`` is still the file this writer created."""
        return same_file(os.path.join(self.path, *name.split("/")), self._idents.get(name))

    def _record(self, entry: ObjectEntry) -> None:
        self._objects[entry.name] = entry

    def _seal(self, name: str) -> ObjectEntry:
        """Checksum and fsync one of accelerate's files; refuse a truncated torch.save archive."""
        path = os.path.join(self._save.folder, *name.split("/"))
        digest, size = Checksum(self.checksum), 0
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())
        if _ARCHIVE_RE.match(name) and not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is not a complete torch.save archive (did save_state fail while writing it?); "
                "the folder stays uncommitted"
            )
        return ObjectEntry(name=name, size=size, checksum=digest.hexdigest())


class _FolderStore(CheckpointStore):
    """Generations that are the folders passed to ``accelerator.save_state`` (not ``<root>/step-N``).

    Thread-safety: ``begin``/``end_write`` may run on the engine's upload thread while the training thread adds
    saves; a lock guards the set of folders being written.
    """

    def __init__(self, run_id: str) -> None:
        super().__init__(os.getcwd(), run_id=run_id, check_writable=False)  # the engine's type; never used
        self.saves: dict[int, _FolderSave] = {}
        self._folder_lock = threading.Lock()
        self._in_progress: set[int] = set()

    def begin(self, step: int) -> _FolderWriter:  # type: ignore[override]
        """Start writing the folder of save ``step``."""
        save = self.saves[step]
        with self._folder_lock:
            if step in self._in_progress:
                raise GenerationExistsError(f"{save.folder} is already being written")
            self._in_progress.add(step)
        os.makedirs(save.folder, exist_ok=True)
        return _FolderWriter(self, save)

    def inflight_location(self, step: int) -> str | None:
        """Where save ``step`` writes, for readers in this process to wait on (:mod:`~lightning_async_ckpt.storage.inflight`).

        Only a save whose commit needs nothing more from the training thread is tracked (all of its files are
        ours). A hook-path folder is committed only after the next call into the checkpointer confirms accelerate's
        part, so a reader that waited for it could wait forever; ``load_state`` confirms and waits for those itself.
        """
        save = self.saves.get(step)
        return save.folder if save is not None and save.settled.is_set() and not save.abandoned else None

    def url(self, step: int, name: str | None = None) -> str:
        """The folder of save ``step`` (or ``name`` inside it)."""
        folder = self.saves[step].folder
        return folder if name is None else os.path.join(folder, *name.split("/"))

    def end_write(self, step: int) -> None:
        """The writer of ``step`` committed or aborted."""
        with self._folder_lock:
            self._in_progress.discard(step)

    def manifest(self, step: int) -> Manifest:
        """The committed manifest of save ``step``'s folder.

        Raises:
            ManifestError: The folder has no valid manifest.
        """
        save = self.saves.get(step)
        if save is None:
            raise ManifestError(f"no save_state folder for step {step}")
        path = os.path.join(save.folder, MANIFEST_NAME)
        try:
            with open(path, "rb") as f:
                return Manifest.from_json(f.read(), where=path)
        except FileNotFoundError as exc:
            raise ManifestError(f"{save.folder} has no manifest") from exc

    def check_sizes(self, manifest: Manifest) -> list[str]:
        """Problems of ``manifest``'s objects in its folder: missing, or another size than listed."""
        save = self.saves.get(manifest.step)
        if save is None:
            return [f"no save_state folder for step {manifest.step}"]
        problems = []
        for obj in manifest.objects:
            try:
                size = os.path.getsize(os.path.join(save.folder, *obj.name.split("/")))
            except FileNotFoundError:
                problems.append(f"{obj.name}: missing")
                continue
            if size != obj.size:
                problems.append(f"{obj.name}: size {size}, manifest says {obj.size}")
        return problems

    def gc(self, keep_last: int, **_: Any) -> list[int]:
        """Nothing: accelerate's ``ProjectConfiguration(total_limit=...)`` owns retention of these folders."""
        return []


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("lightning_async_ckpt", "torch", "accelerate", "fsspec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _release_unsettled(unsettled: list[_FolderSave], multi: bool) -> None:
    # An unreachable checkpointer means an unreachable accelerator: no save_state of it is running. One process
    # knows its own part is done; several processes cannot agree any more, so their folders stay uncommitted.
    for save in unsettled:
        if multi:
            save.abandon()
        else:
            save.settle()
    unsettled.clear()
