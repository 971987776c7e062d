"""The newest intact generation across a folder and its version folders, read through the store facade."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.storage.finder import list_steps, newest_in
from lightning_async_ckpt.storage.generation import VERSION_RE, GenerationInfo, subfolders_holding_checkpoints
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["Found", "newest_intact", "warn_if_nested"]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass(frozen=True)
class Found:
    """The generation :func:`newest_intact` chose: the store holding it and its verified manifest."""

    store: CheckpointStore
    info: GenerationInfo
    version: int

    @property
    def manifest(self) -> Manifest:
        """The generation's manifest."""
        assert self.info.manifest is not None
        return self.info.manifest


def newest_intact(
    dirpath: str,
    storage_options: dict[str, Any] | None,
    *,
    accept: Callable[[Manifest], bool],
    on_skip: Callable[[str, tuple[str, ...]], None],
) -> Found | None:
    """The newest intact generation of ``dirpath`` and its version folders that ``accept`` takes.

    The highest version folder holding one wins (``dirpath`` itself is version 0); within a folder, the highest step
    (never the writers' clocks). Each folder is listed once (again when generations vanish
    under the reader) and its manifests are read newest first, so an intact newest generation costs one manifest read
    and its verification (every object re-read against its checksum). One that fails verification is reported to
    ``on_skip`` with its problems and the next is tried.

    Raises:
        StoreUnavailableError: ``dirpath`` or a version folder cannot be listed.
        StorageError: Generations kept vanishing under the reader (:func:`~.finder.newest_in`).
    """
    root = CheckpointStore(dirpath, storage_options, check_writable=False)
    listing = list_steps(root.location)
    for version in sorted(listing.versions, reverse=True) + [0]:
        uri = f"{dirpath.rstrip('/')}/v{version}" if version else dirpath
        store = CheckpointStore(uri, storage_options, check_writable=False) if version else root

        def check(info: GenerationInfo, store: CheckpointStore = store) -> tuple[str, ...]:
            return store.verify(info.step, manifest=info.manifest).problems

        info = newest_in(
            store.location,
            accept=lambda i: i.manifest is not None and accept(i.manifest),
            check=check,
            on_skip=on_skip,
            listing=None if version else listing,
        )
        if info is not None:
            return Found(store, info, version)
    return None


def warn_if_nested(dirpath: str, storage_options: dict[str, Any] | None, *, stacklevel: int = 2) -> None:
    """``dirpath`` holds no generation: warn when its subfolders (not its versions) do.

    ``None`` from a lookup starts training from scratch when the path was given one level too high; a nested
    callback's folder is legitimate, so this only warns. ``stacklevel`` is ``warnings.warn``'s, counted from here.
    """
    store = CheckpointStore(dirpath, storage_options, check_writable=False)
    try:
        nested = subfolders_holding_checkpoints(store.fs, store.root, exclude=VERSION_RE)
    except FileNotFoundError:
        return
    if nested:
        message = (
            f"latest_checkpoint({dirpath!r}) found no checkpoint there, but these subfolders hold some: "
            f"{', '.join(nested[:5])}; returning None (a fresh start). If the run wrote to one of them, pass it "
            f"(e.g. {dirpath.rstrip('/')}/{nested[0]})"
        )
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=stacklevel + 1)
