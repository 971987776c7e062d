"""Hook-path generations: the folders passed to ``accelerator.save_state``, as a store, writer and save."""

from __future__ import annotations

import os
import threading
import zipfile
from dataclasses import dataclass, field
from typing import Any

from lightning_async_ckpt.accelerate._layout import _ARCHIVE_RE, INCOMPLETE_MARKER, _log
from lightning_async_ckpt.core.engine import SaveHandle
from lightning_async_ckpt.errors import CheckpointError, GenerationExistsError, ManifestError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest, ObjectEntry, validate_object_name
from lightning_async_ckpt.storage.store import CheckpointStore, GenerationWriter, _Checksum, _fsync_dir


# -- folder generations (hook path) ------------------------------------------------------------------------
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
        self.abandoned = True
        self.settled.set()


class _FolderWriter(GenerationWriter):
    """Writes our objects into accelerate's folder; commit waits for accelerate's part, then seals its files."""

    def __init__(self, store: _FolderStore, save: _FolderSave) -> None:
        super().__init__(store, save.step, store.checksum)
        self._save = save
        self._own: set[str] = set()

    def open(self, name: str) -> Any:
        self._own.add(name)
        return super().open(name)

    def commit(self, **kwargs: Any) -> Manifest:
        save = self._save
        save.settled.wait()
        if save.abandoned:
            raise CheckpointError(
                f"{save.folder}: save_state was never confirmed finished on every process (close() was not called); "
                "the folder stays uncommitted"
            )
        missing = sorted(save.expected - set(save.listing))
        if missing:
            raise CheckpointError(f"accelerate did not write {missing} into {save.folder}; it stays uncommitted")
        for name in save.listing:
            if name not in self._own:
                self._record(self._seal(name))
        _fsync_dir(save.folder)
        manifest = super().commit(**kwargs)
        marker = os.path.join(save.folder, INCOMPLETE_MARKER)
        if os.path.exists(marker):
            os.unlink(marker)
            _fsync_dir(save.folder)
        return manifest

    def _seal(self, name: str) -> ObjectEntry:
        """Checksum and fsync one of accelerate's files; refuse a truncated torch.save archive."""
        path = os.path.join(self._save.folder, name)
        digest, size = _Checksum(self.checksum), 0
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())
        if _ARCHIVE_RE.match(name) and not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is not a complete torch.save archive (did save_state fail while writing it?); "
                "the folder stays uncommitted"
            )
        return ObjectEntry(name=name, size=size, checksum=digest.hexdigest())

    def abort(self) -> None:
        # Only our own objects: accelerate's files in the folder are not ours to delete.
        if self._done:
            return
        self._done = True
        for name in self._own:
            try:
                os.unlink(os.path.join(self._save.folder, name))
            except FileNotFoundError:
                pass
        self.store._end_write(self.step)


class _FolderStore(CheckpointStore):
    """A store whose generations are the folders passed to ``accelerator.save_state`` (not ``<root>/step-N``)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(os.getcwd(), run_id=run_id, check_writable=False)  # the root is never written
        self.saves: dict[int, _FolderSave] = {}

    def _gen_path(self, step: int) -> str:
        save = self.saves.get(step)
        return save.folder if save is not None else super()._gen_path(step)

    def begin(self, step: int) -> GenerationWriter:
        save = self.saves[step]
        with self._lock:
            if step in self._writing:
                raise GenerationExistsError(f"{save.folder} is already being written")
            self._writing.add(step)
        os.makedirs(save.folder, exist_ok=True)
        return _FolderWriter(self, save)

    def gc(self, keep_last: int, **_: Any) -> list[int]:
        return []  # accelerate's ProjectConfiguration(total_limit=...) owns retention of these folders


def _release_unsettled(unsettled: list[_FolderSave], multi: bool) -> None:
    # An unreachable checkpointer means an unreachable accelerator: no save_state of it is running. One process
    # knows its own part is done; several processes cannot agree any more, so their folders stay uncommitted.
    for save in unsettled:
        if multi:
            save.abandon()
        else:
            save.settle()
    unsettled.clear()
