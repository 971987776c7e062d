"""The backend seam: what differs between local disk, S3 and any other fsspec filesystem.

Everything above this module (writer, store, retention) calls these few methods and never asks which
filesystem it runs on. The guarantees differ per backend; ``docs/storage.md`` tabulates them:

=========  ===============================================  ==========================================
backend    exclusive create (manifest, writer claim)         durability
=========  ===============================================  ==========================================
local      ``os.link`` of a fsynced temp file (``EEXIST``)  fsync of file and folder
s3         ``PutObject`` with ``If-None-Match: *``          the PUT is durable when acknowledged
other      check, then write (best effort, racy)            whatever the filesystem promises
=========  ===============================================  ==========================================
"""

from __future__ import annotations

import os
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_async_ckpt.storage.io import exclusive_local_write, fsync_dir, open_local_write

__all__ = ["Backend", "backend_for", "protocols"]


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """The protocol names of ``fs``."""
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class Backend:
    """Best-effort operations of any fsspec filesystem; subclasses make them exact where the backend can.

    Args:
        fs: The filesystem.
        block_size: Multipart block size for object stores (``None``: the backend's default).
    """

    kind = "fsspec"
    #: How :meth:`create_exclusive` decides between two writers (documented per backend).
    exclusive = "best effort: check, then write"

    def __init__(self, fs: fsspec.AbstractFileSystem, block_size: int | None = None) -> None:
        self.fs = fs
        self.block_size = block_size

    def open_write(self, path: str, *, direct_io: bool, subfolder: bool) -> IO[bytes]:
        """Open a data object for streaming writes (folders created as needed)."""
        if subfolder:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return self.fs.open(path, "wb")

    def finish(self, raw: Any) -> None:
        """Make a written object durable and close it."""
        raw.close()

    def discard(self, raw: Any) -> None:
        """Close an object after a failed write without publishing it (aborts a multipart upload)."""
        discard = getattr(raw, "discard", None)
        if callable(discard):
            discard()
        try:
            raw.close()
        except Exception:  # noqa: BLE001 - a discarded buffer cannot be flushed; nothing was published
            pass

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` only if nothing is there.

        Raises:
            FileExistsError: Something is at ``path`` (this writer lost).
        """
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    def prepare_folder(self, path: str) -> None:
        """Create a generation folder where folders exist."""

    def sync_folder(self, path: str) -> None:
        """Make entries created or removed in ``path`` durable."""

    def remove_folder_if_empty(self, path: str) -> None:
        """Remove an emptied generation folder (object stores have none)."""
        try:
            if not self.fs.find(path):
                self.fs.rm(path, recursive=True)
        except (FileNotFoundError, NotImplementedError, OSError):
            pass

    def inside(self, path: str, root: str) -> bool:
        """Whether ``path`` resolves inside ``root`` (only local disks have symlinks to escape through)."""
        return True

    def url(self, path: str) -> str:
        """A full URL of ``path`` (with protocol)."""
        return self.fs.unstrip_protocol(path)

    def missing_root_error(self, root: str) -> str | None:
        """Why a root that lists as missing cannot be read, or ``None`` when missing simply means empty."""
        return None


class LocalBackend(Backend):
    """Local disk: fsync everywhere, ``O_DIRECT`` data writes, exclusive create through ``os.link``."""

    kind = "local"
    exclusive = "exact: fsynced temp file, os.link to the final name (EEXIST loses)"

    def open_write(self, path: str, *, direct_io: bool, subfolder: bool) -> IO[bytes]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open_local_write(path, direct_io)  # type: ignore[return-value]

    def finish(self, raw: Any) -> None:
        raw.flush()
        os.fsync(raw.fileno())
        raw.close()

    def discard(self, raw: Any) -> None:
        raw.close()

    def create_exclusive(self, path: str, data: bytes) -> None:
        exclusive_local_write(path, data)

    def prepare_folder(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def sync_folder(self, path: str) -> None:
        fsync_dir(path)

    def remove_folder_if_empty(self, path: str) -> None:
        # Bottom-up rmdir: a folder that is not empty (another writer's objects) is left, atomically.
        for folder, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
            try:
                os.rmdir(folder)
            except OSError:
                return
        fsync_dir(os.path.dirname(path))

    def inside(self, path: str, root: str) -> bool:
        real_root = os.path.realpath(root)
        return os.path.realpath(path).startswith(real_root.rstrip(os.sep) + os.sep)

    def url(self, path: str) -> str:
        return path


class S3Backend(Backend):
    """S3 (s3fs): multipart streams aborted on failure, exclusive create through a conditional PUT."""

    kind = "s3"
    exclusive = "exact: PutObject with If-None-Match: * (412 loses)"

    def open_write(self, path: str, *, direct_io: bool, subfolder: bool) -> IO[bytes]:
        return self.fs.open(path, "wb", block_size=self.block_size or 32 << 20)

    def create_exclusive(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise
        except OSError as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                raise FileExistsError(path) from exc
            raise

    def remove_folder_if_empty(self, path: str) -> None:
        return

    def missing_root_error(self, root: str) -> str | None:
        bucket = root.split("/", 1)[0]
        try:
            self.fs.ls(bucket, detail=False)
        except FileNotFoundError:
            return f"bucket {bucket!r} does not exist (or these credentials cannot see it)"
        except Exception as exc:  # noqa: BLE001 - reported as the reason the store cannot be listed
            return f"bucket {bucket!r} cannot be listed: {type(exc).__name__}: {exc}"
        return None


def backend_for(fs: fsspec.AbstractFileSystem, block_size: int | None = None) -> Backend:
    """The backend that fits ``fs``."""
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(fs, block_size)
    if "s3" in protocols(fs) and type(fs).__module__.startswith("s3fs"):
        return S3Backend(fs, block_size)
    return Backend(fs, block_size)
