"""Where a store lives: its filesystem, root path and URL, and the naming facts its helpers share.

The facade builds a frozen :class:`StoreRoot` and hands it down, so the helpers never import the facade back.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from lightning_async_ckpt.errors import ManifestError, ManifestVersionError
from lightning_async_ckpt.storage.backend import Backend
from lightning_async_ckpt.storage.generation import GenerationInfo, generation_name
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, validate_object_name
from lightning_async_ckpt.storage.regular import NotRegularFileError

__all__ = ["StoreRoot", "comparable_path"]


def comparable_path(path: str) -> str:
    """``path`` in a form two spellings of one place share: a URL without its trailing ``/``, a local path resolved
    (absolute, symlinks followed)."""
    path = path.rstrip("/")
    return path if "://" in path else os.path.realpath(path)


@dataclass(frozen=True, eq=False)
class StoreRoot:
    """One store's place: the fsspec filesystem, the root path on it, and how its objects are named and read.

    Args:
        uri: The location as the user gave it (a path or fsspec URL).
        storage_options: The fsspec filesystem's options.
        fs: The fsspec filesystem.
        root: The root path on ``fs`` (no protocol, no trailing slash).
        backend: What differs per filesystem (:mod:`.backend`).
        checksum: The checksum algorithm of new objects.
        direct_io: Write data objects with ``O_DIRECT`` on local disks where supported.
        hashed_prefixes: Sharded saves write data files under hashed prefixes (``<root>/spread/<h>/step-N/``).
    """

    uri: str
    storage_options: dict[str, Any] = field(repr=False)
    fs: Any = field(repr=False)
    root: str
    backend: Backend = field(repr=False)
    checksum: str
    direct_io: bool = True
    hashed_prefixes: bool = False

    @property
    def is_local(self) -> bool:
        """Whether the store is on a local disk."""
        return self.backend.kind == "local"

    def generation_path(self, step: int) -> str:
        """Path of generation ``step``'s folder on the filesystem (no protocol)."""
        return f"{self.root}/{generation_name(step)}"

    def url(self, step: int, name: str | None = None) -> str:
        """Full URL (with protocol) of a generation folder, or of ``name``'s default location in it."""
        path = (
            self.generation_path(step) if name is None else f"{self.generation_path(step)}/{validate_object_name(name)}"
        )
        return self.backend.url(path)

    def invalidate_cache(self) -> None:
        """Drop the filesystem's listing cache, so the next listing sees what other processes wrote."""
        # s3fs caches listings; a stale cache is how `last` lookups go wrong on object stores.
        with contextlib.suppress(Exception):  # not every filesystem caches
            self.fs.invalidate_cache()

    def read_generation(self, step: int) -> GenerationInfo:
        """The one manifest reader: size-capped, validated, its step checked against the folder's."""
        path = self.generation_path(step)
        url = self.url(step)
        try:
            data = self.backend.read_capped(f"{path}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return GenerationInfo(step=step, path=url, committed=False, mtime=self.backend.mtime(path))
        except NotRegularFileError as exc:  # a FIFO or device is never a manifest: rejected, never opened
            return GenerationInfo(step=step, path=url, committed=False, error=f"{MANIFEST_NAME} is {exc.strerror}")
        except Exception as exc:  # noqa: BLE001 - an unreadable manifest makes the generation untrusted, not fatal
            # Present but unreadable right now (a transient storage error): never treated as a leftover.
            error = f"unreadable manifest: {exc}"
            return GenerationInfo(step=step, path=url, committed=False, error=error, unreadable=True)
        try:
            manifest = Manifest.from_json(data, where=f"{url}/{MANIFEST_NAME}")
            if manifest.step != step:
                raise ManifestError(f"manifest of folder step {step} says step {manifest.step}")
        except ManifestError as exc:
            newer = isinstance(exc, ManifestVersionError)
            return GenerationInfo(step=step, path=url, committed=False, error=str(exc), newer_format=newer)
        return GenerationInfo(step=step, path=url, committed=True, manifest=manifest, mtime=manifest.committed_at)
