"""DCP's file-system seam over a store: objects created exclusively under the attempt's token, each checksummed.

Thread-safety: DCP's I/O threads share one instance; its records are guarded by a lock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.storage.claims import Lease
from lightning_async_ckpt.storage.io import ChecksumWriter, file_identity, fsync_dir, same_file
from lightning_async_ckpt.storage.manifest import SPREAD_FOLDER, ObjectEntry, spread_path, validate_object_name

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["ChecksumStream", "StoreFileSystem"]

_log = logging.getLogger(__name__)
# DCP's data files and temporary files: always written under a name that carries the attempt's token.
_TOKENED_RE = re.compile(r"^(__[0-9]+_[0-9]+\.distcp|.*\.tmp)$")
_DATA_RE = re.compile(r"^__[0-9]+_[0-9]+\.distcp$")  # DCP's per-rank data files: spread with hashed_prefixes


class ChecksumStream(ChecksumWriter):
    """Write-only stream over a backend object: counts and checksums bytes; closing is left to the file system."""

    def __init__(self, raw: IO[bytes], algorithm: str, renew: Callable[[], None]) -> None:
        super().__init__(raw, algorithm)
        self._renew = renew

    def write(self, data: Any) -> int:
        n = super().write(data)
        self._renew()
        return n

    def flush(self) -> None:
        # The backend flushes and syncs once at the end; a direct-I/O file must not flush its tail early.
        pass

    def close(self) -> None:
        # DCP closes the stream inside its ``with``; the file system makes it durable after the block.
        pass


class StoreFileSystem(FileSystemBase):
    """DCP's file-system seam over a store's fsspec filesystem and backend; records every object written.

    Objects are created exclusively; DCP's data and temporary files (and the names in :attr:`tokened`) get the
    attempt's token appended to their file name (:meth:`physical`), the object's name stays DCP's.
    """

    def __init__(self, store: CheckpointStore, generation: str) -> None:
        self.store = store
        self.generation = generation.rstrip("/")
        self.objects: dict[str, ObjectEntry] = {}
        self.token: str | None = None
        self.lease: Lease | None = None
        self.tokened: set[str] = set()
        #: Expected sizes (DCP path -> bytes), and of each DCP data file: object stores size their parts from them.
        self.sizes: dict[str, int] = {}
        self.data_size: int | None = None
        self._created: dict[str, tuple[int, int] | None] = {}
        self._lock = threading.Lock()

    def physical(self, path: str) -> str:
        """Where the object DCP calls ``path`` is written: its name with the token appended where it must be.

        With the store's ``hashed_prefixes``, a DCP data file goes below the root's spread folder
        (:func:`~lightning_async_ckpt.storage.manifest.spread_path`): a full path maps to the full spread path, a
        path relative to the generation folder (what DCP's ``.metadata`` records) to ``../spread/...``.
        """
        name = path.rsplit("/", 1)[-1]
        if not (self.token and (_TOKENED_RE.match(name) or name in self.tokened)):
            return path
        if self.store.hashed_prefixes and _DATA_RE.match(name):
            spread = spread_path(self.generation.rsplit("/", 1)[-1], f"{name}.{self.token}")
            return f"{self.store.root}/{spread}" if path.startswith(self.generation + "/") else f"../{spread}"
        return f"{path}.{self.token}"

    def location(self, entry: ObjectEntry) -> str:
        """The full path of a recorded object (in the generation folder, or spread)."""
        return f"{self.store.root}/{entry.root_path}" if entry.root_path else f"{self.generation}/{entry.key}"

    def renew(self) -> None:
        """Renew this rank's lease when due (at each write)."""
        if self.lease is not None:
            self.lease.renew()

    def _entry(self, path: str, size: int, checksum: str, physical: str | None = None) -> ObjectEntry:
        # Relative to the generation folder: a writer under another writer's claim writes below its own prefix.
        physical = physical or path
        name = validate_object_name(path.rsplit("/", 1)[-1])
        spread = f"{self.store.root}/{SPREAD_FOLDER}/"
        if physical.startswith(spread):
            return ObjectEntry(name=name, size=size, checksum=checksum, root_path=physical[len(self.store.root) + 1 :])
        gen = self.generation + "/"
        rel = physical[len(gen) :] if physical.startswith(gen) else physical.rsplit("/", 1)[-1]
        return ObjectEntry(name=name, size=size, checksum=checksum, path=rel if rel != name else None)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = str(path)
        if "w" not in mode:
            with self.store.fs.open(path, mode) as f:
                yield f
            return
        physical = self.physical(path)
        entry = self._entry(path, 0, "", physical)
        backend = self.store.backend
        try:
            size = self.sizes.get(path) or (self.data_size if path.endswith(".distcp") else None)
            subfolder = "/" in entry.key or entry.root_path is not None
            raw = backend.open_write(physical, direct_io=self.store.direct_io, subfolder=subfolder, size=size)
        except Exception as exc:
            raise StorageError(f"could not create {physical!r} for writing: {exc}") from exc
        with self._lock:
            self._created[physical] = file_identity(raw) if self.store.is_local else None
        stream = ChecksumStream(raw, self.store.checksum, self.renew)
        try:
            yield stream
        except BaseException:
            try:
                backend.discard(raw)
            except Exception:  # noqa: BLE001 - the write's own error is the one that decides (and retries)
                _log.debug("discarding %s after a failed write failed", physical, exc_info=True)
            raise
        try:
            backend.finish(raw)
        except Exception as exc:
            raise StorageError(f"could not finish {physical!r}: {exc}") from exc
        with self._lock:
            self.objects[entry.name] = self._entry(path, stream.size, stream.checksum, physical)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """Publish a written temporary object (DCP's ``.metadata``) exclusively: never replaces an existing one.

        Raises:
            StorageError: Something is at ``new_path`` already (another attempt published it).
        """
        source, new_path = self.physical(str(path)), str(new_path)
        try:
            if self.store.is_local:
                os.link(source, new_path)
                os.unlink(source)
                fsync_dir(os.path.dirname(new_path))
            else:
                data = self.store.fs.cat_file(source)
                try:
                    # Exclusive, throttling retried in the backend (a retry that finds its own bytes succeeds).
                    self.store.backend.create_claim(new_path, data)
                except FileExistsError:
                    if not self.store.backend.holds(new_path, data):  # another attempt's names its own files
                        raise
                self.store.fs.rm_file(source)
        except FileExistsError as exc:
            raise StorageError(f"{new_path!r} exists: another attempt published it; this one is not committed") from exc
        old = str(path).rsplit("/", 1)[-1]
        with self._lock:
            self._created[new_path] = self._created.pop(source, None)
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

    def created(self) -> frozenset[str]:
        """The objects created so far (physical paths): what :meth:`undo` keeps."""
        with self._lock:
            return frozenset(self._created)

    def undo(self, keep: frozenset[str]) -> None:
        """Remove every object created since :meth:`created` returned ``keep``, and forget its record.

        After a failed (throttled) write: the retry starts from a clean folder and never records a partial object.
        """
        with self._lock:
            gone = [path for path in self._created if path not in keep]
            identities = {path: self._created.pop(path) for path in gone}
            for name, entry in list(self.objects.items()):
                if self.location(entry) in identities:
                    del self.objects[name]
        for path, identity in identities.items():
            try:
                if identity is None or same_file(path, identity):
                    self.store.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def rm_file(self, path: str | os.PathLike) -> None:
        """Remove an object this attempt created; anything else (another attempt's ``.metadata``) is left."""
        path = self.physical(str(path))
        with self._lock:
            if path not in self._created:
                return
            identity = self._created.pop(path)
        if identity is None or same_file(path, identity):
            self.store.fs.rm_file(path)
