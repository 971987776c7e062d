"""Lightning's checkpoint loads routed through a store: :class:`StoreReader` (used by ``lightning/resume.py``)."""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from lightning_async_ckpt.errors import CheckpointError, ManifestError
from lightning_async_ckpt.lightning.last import stand_in_for_last
from lightning_async_ckpt.lightning.naming import version_uri
from lightning_async_ckpt.storage.finder import RELISTS
from lightning_async_ckpt.storage.generation import parse_generation_name
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["StoreReader"]

_log = logging.getLogger("lightning_async_ckpt")
_ALIAS_ROOT = "memory://lightning_async_ckpt-resume"
_LAST_PREFIX = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST


def _keep_storage(storage: Any, location: Any) -> Any:
    return storage  # TorchCheckpointIO's default map_location


class StoreReader:
    """Loads checkpoints inside one ``dirpath`` for Lightning through the store's filesystem and options.

    Thread-safety: used on the training thread only.

    Args:
        dirpath: The callback's ``dirpath``.
        storage_options: fsspec options for ``dirpath``.
    """

    def __init__(self, dirpath: str, storage_options: dict[str, Any] | None) -> None:
        self.dirpath = dirpath
        self.storage_options = storage_options
        self._root = CheckpointStore(dirpath, storage_options, check_writable=False)
        self.root_url = self._root.backend.url(self._root.root).rstrip("/")
        self._aliases: dict[str, str] = {}
        self._io: Any = None
        self.loaded: str | None = None  # the store URL of the last checkpoint loaded through this reader
        self.offered: set[str] = set()  # what ckpt_path="last" was answered with (re-chosen when it vanishes)
        self.last_name = _LAST_PREFIX  # ModelCheckpoint.CHECKPOINT_NAME_LAST of the callback
        self.last_extension = ".ckpt"  # ModelCheckpoint.FILE_EXTENSION of the callback

    @property
    def remote(self) -> bool:
        """Whether Lightning's own loader may lack what it needs to open ``dirpath`` (anything not local)."""
        return not self._root.is_local

    def alias(self, url: str) -> str:
        """A path Lightning's option-less lookup can see and date, standing for ``url`` (an in-memory marker)."""
        import fsspec

        alias = f"{_ALIAS_ROOT}/{uuid.uuid4().hex[:12]}/{url.split('://', 1)[-1]}"
        fsspec.filesystem("memory").pipe_file(alias, url.encode())
        self._aliases[alias] = url
        return alias

    def resolve(self, path: Any) -> str | None:
        """The store URL ``path`` stands for, or ``None`` when it is not inside ``dirpath``."""
        text = str(path)
        if text in self._aliases:
            return self._aliases[text]
        return text if text.startswith(self.root_url + "/") else None

    def install(self, checkpoint_io: Any, newest: Callable[[], str | None] | None = None) -> None:
        """Route ``checkpoint_io.load_checkpoint`` of paths inside a remote ``dirpath`` through the store.

        Args:
            checkpoint_io: The strategy's checkpoint IO.
            newest: What ``ckpt_path="last"`` resumes from (a real path or URL), asked when Lightning loads a
                ``<dirpath>/last.ckpt`` that does not exist; ``None``: such a path is loaded as it is.
        """
        self._uninstall()
        self.loaded = None
        original = checkpoint_io.load_checkpoint

        def load_once(path: Any, replaced: str | None, args: Any, kwargs: Any) -> Any:
            url = self.resolve(path) if self.remote else None
            if url is None:
                checkpoint = original(path, *args, **kwargs)
                self.loaded = replaced
                return checkpoint
            map_location = kwargs.get("map_location", args[0] if args else _keep_storage)
            weights_only = kwargs.get("weights_only", args[1] if len(args) > 1 else None)
            try:
                checkpoint = self.load(url, map_location=map_location, weights_only=weights_only)
            finally:
                self._forget(str(path))
            self.loaded = url
            return checkpoint

        def load_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
            stand_in = stand_in_for_last(self._root.fs, self.dirpath, path, newest)
            path = path if stand_in is None else stand_in
            if stand_in is not None:
                self.offered.add(stand_in)
            for _ in range(RELISTS):
                try:
                    return load_once(path, stand_in, args, kwargs)
                except (FileNotFoundError, ManifestError) as exc:
                    # What "last" chose was retired (another writer's retention) before Lightning read it: the
                    # newest one now, never a fresh start or an error.
                    if newest is None or str(path) not in self.offered:
                        raise
                    again = newest()
                    if again is None or again == self.resolve(path) or again == str(path):
                        raise
                    _log.warning("ckpt_path='last': %s vanished before it was read (%s); loading %s", path, exc, again)
                    self.offered.add(again)
                    path = stand_in = again
            raise CheckpointError(
                f"ckpt_path='last' in {self.dirpath}: every checkpoint chosen vanished before it was read"
            )

        checkpoint_io.load_checkpoint = load_checkpoint
        self._io = (checkpoint_io, load_checkpoint)

    def remove(self) -> None:
        """Undo :meth:`install` and drop the in-memory markers."""
        self._uninstall()
        for alias in list(self._aliases):
            self._forget(alias)

    def _uninstall(self) -> None:
        if self._io is not None:
            checkpoint_io, installed = self._io
            if checkpoint_io.__dict__.get("load_checkpoint") is installed:
                del checkpoint_io.load_checkpoint
            self._io = None

    def modified(self, url: str) -> float:
        """Modification time of ``url`` on the store's filesystem (0 when it cannot be read)."""
        fs = self._root.fs
        try:
            return fs.modified(url).timestamp()
        except Exception:  # noqa: BLE001 - an undatable candidate loses to a datable one
            return 0.0

    def model_checkpoint_last_files(self) -> list[str]:
        """``ModelCheckpoint``'s last files directly in ``dirpath``, by its ``_find_last_checkpoints`` rule: the stem
        starts with :attr:`last_name` (``CHECKPOINT_NAME_LAST``, ``last-v1`` included), the suffix is
        :attr:`last_extension` (``FILE_EXTENSION``)."""
        try:
            names = self._root.fs.ls(self._root.root, detail=False)
        except FileNotFoundError:
            return []
        pattern = rf"^{re.escape(self.last_name)}(-(\d+))?"
        found = []
        for name in names:
            base = PurePosixPath(name.rstrip("/").rsplit("/", 1)[-1])
            if base.suffix == self.last_extension and re.match(pattern, base.stem) and self._root.fs.isfile(name):
                found.append(self._root.backend.url(name))
        return sorted(found)

    def load(self, url: str, *, map_location: Any = _keep_storage, weights_only: bool | None = None) -> Any:
        """``torch.load`` of object ``url`` of a committed generation, read with the store's options.

        A ``ModelCheckpoint`` ``last*.ckpt`` file directly in ``dirpath`` is loaded as it is (no manifest).

        Raises:
            ManifestError: ``url`` is not an object of a committed generation of ``dirpath`` (or a version).
        """
        import torch

        parts = url[len(self.root_url) + 1 :].split("/")
        if len(parts) == 1 and url in self.model_checkpoint_last_files():
            with self._root.fs.open(url, "rb") as f:
                return torch.load(f, map_location=map_location, weights_only=weights_only)
        version = 0
        if parts and parts[0].startswith("v") and parts[0][1:].isdigit():
            version, parts = int(parts[0][1:]), parts[1:]
        step = parse_generation_name(parts[0]) if parts else None
        if step is None or len(parts) < 2:
            raise ManifestError(f"{url} is not an object of a checkpoint generation under {self.dirpath!r}")
        store = CheckpointStore(version_uri(self.dirpath, version), self.storage_options, check_writable=False)
        key = "/".join(parts[1:])
        for obj, obj_url in store.iter_objects(step):  # raises ManifestError when the step is not committed
            if obj.key == key:
                _log.info("loading %s through the store (storage_options applied)", obj_url)
                with store.fs.open(obj_url, "rb") as f:
                    return torch.load(f, map_location=map_location, weights_only=weights_only)
        raise ManifestError(f"{url}: committed generation step {step} lists no object {key!r}")

    def _forget(self, alias: str) -> None:
        if self._aliases.pop(alias, None) is None:
            return
        import fsspec

        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm_file(alias)
