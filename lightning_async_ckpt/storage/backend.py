"""The backend seam: what differs between local disk, S3 and any other fsspec filesystem.

Everything above this module calls these few methods and never asks which filesystem it runs on. Exclusive create
is ``os.link`` of a fsynced temp file locally and ``If-None-Match: *`` on S3 (best effort elsewhere);
``docs/storage.md`` tabulates each backend's guarantees.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.io import exclusive_local_write, fsync_dir, open_local_write
from lightning_async_ckpt.storage.regular import NotRegularFileError, RegularLocalFileSystem
from lightning_async_ckpt.storage.throttling import PutRetry, put_exclusive

__all__ = [
    "DEFAULT_PART_SIZE",
    "MAX_PART_SIZE",
    "PARTS_PER_OBJECT",
    "Backend",
    "backend_for",
    "open_filesystem",
    "part_size",
    "protocols",
]

#: S3's part limits: at least 5 MiB (but the last), at most 10,000 parts per upload.
_S3_MIN_PART, _S3_MAX_PARTS, _MIB = 5 << 20, 10_000, 1 << 20
#: The part size of an object of unknown size (s3fs buffers one part per open stream).
DEFAULT_PART_SIZE = 32 << 20
#: The part size grows for large objects until an object takes at most this many parts...
PARTS_PER_OBJECT = 64
#: ...but never above this (memory: one part per open stream), except as S3's 10,000-part limit needs.
MAX_PART_SIZE = 256 << 20


def part_size(size: int | None, configured: int | None = None, *, parts: int = PARTS_PER_OBJECT) -> int:
    """The multipart part size for an object of ``size`` bytes (``None``: unknown), whole MiB.

    ``configured`` for objects up to ``parts`` parts of it; larger objects get larger parts (so they take ``parts``
    parts) up to :data:`MAX_PART_SIZE`, and beyond that only as large as S3's 10,000-part limit needs.
    """
    base = max(configured or DEFAULT_PART_SIZE, _S3_MIN_PART)
    if not size or size <= 0:
        return base
    wanted = min(max(base, -(-size // parts)), max(MAX_PART_SIZE, base))
    part = max(wanted, -(-size // _S3_MAX_PARTS))
    return -(-part // _MIB) * _MIB


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
        #: Retries of a throttled exclusive PUT (manifest, ``.metadata``, claims); ``None``: the default policy.
        self.put_retry: PutRetry | None = None

    def open_write(self, path: str, *, direct_io: bool, subfolder: bool, size: int | None = None) -> IO[bytes]:
        """Open a data object for streaming writes (folders created as needed).

        ``size``: the object's expected size when known (an estimate is fine): object stores choose the part size
        from it (:func:`part_size`).
        """
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
        with contextlib.suppress(Exception):  # a discarded buffer cannot be flushed; nothing was published
            raw.close()

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` only if nothing is there.

        A throttled PUT (503 SlowDown, 429, a reset connection) is retried exclusively (:attr:`put_retry`); a retry
        that finds exactly ``data`` there (its earlier PUT landed, the answer was lost) succeeds
        (:func:`~lightning_async_ckpt.storage.throttling.put_exclusive`).

        Raises:
            FileExistsError: Something else is at ``path`` (this writer lost).
        """
        self._retried(lambda: self._exclusive(path, data), path, data)

    def create_claim(self, path: str, data: bytes) -> None:
        """Create a writer claim at ``path`` only if none is there (as :meth:`create_exclusive`, retried alike).

        Written as a stream rather than one ``pipe_file``, so the only ``pipe_file`` of a generation stays its
        manifest (what operators and fault plans count).

        Raises:
            FileExistsError: A claim is there.
        """
        self._retried(lambda: self._claim(path, data), path, data)

    def holds(self, path: str, data: bytes) -> bool:
        """Whether ``path`` holds exactly ``data`` (a PUT whose answer was lost landed); unreadable: not provably."""
        try:
            return self.fs.cat_file(path) == data
        except Exception:  # noqa: BLE001 - unreadable is not provably this writer's
            return False

    def _retried(self, put: Any, path: str, data: bytes) -> None:
        put_exclusive(
            put, landed=lambda: self.holds(path, data), policy=self.put_retry, what=f"exclusive PUT of {path}"
        )

    def _exclusive(self, path: str, data: bytes) -> None:
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    def _claim(self, path: str, data: bytes) -> None:
        if self.fs.exists(path):
            raise FileExistsError(path)
        try:
            with self.fs.open(path, "wb") as f:
                f.write(data)
        except BaseException:
            with contextlib.suppress(Exception):  # the write's own error is the one to report
                self.fs.rm_file(path)  # a torn claim would name an unknown writer
            raise

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

    def check_writable(self, root: str, uri: str, name: str = "dirpath") -> None:
        """Fail before training when ``root`` cannot hold checkpoints.

        Local disk and ``memory://`` are written to; elsewhere the bucket (or root) must exist and be listable.
        ``name`` is the argument the error names (``dirpath``, ``local_dirpath``).

        Raises:
            ConfigError: Naming the location (and the bucket) and the fix.
        """
        if self.kind != "local" and "memory" not in protocols(self.fs):
            why = self.missing_root_error(root)
            if why is not None:
                raise ConfigError(f"{name} {uri!r} cannot be used: {why}; create it or fix the URL")
            return
        try:
            self.fs.makedirs(root, exist_ok=True)
            probe = f"{root}/.write-probe-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as exc:
            raise ConfigError(
                f"{name} {uri!r} is not writable ({exc}); choose a writable folder or fix its permissions"
            ) from exc

    def read_capped(self, path: str, limit: int) -> bytes:
        """Read at most ``limit + 1`` bytes of ``path`` (so a caller can tell an oversized file without reading it)."""
        try:
            return self.fs.cat_file(path, start=0, end=limit + 1)
        except (FileNotFoundError, NotRegularFileError):
            raise
        except Exception as exc:
            # Object stores refuse a range on an empty object: that one is read as empty.
            try:
                empty = self.fs.info(path).get("size") == 0
            except Exception:  # noqa: BLE001 - the read's own error is the one to report
                empty = False
            if empty:
                return b""
            raise exc from None

    def open_read(self, path: str, stat: dict[str, Any]) -> IO[bytes]:
        """Open an object for one sequential read, given what ``fs.info`` just said of it (``stat``)."""
        return self.fs.open(path, "rb")

    def mtime(self, path: str) -> float | None:
        """Modification time of ``path`` when the filesystem reports one (informational)."""
        try:
            info = self.fs.info(path)
        except Exception:  # noqa: BLE001 - the age of a leftover is informational
            return None
        value = info.get("mtime") or info.get("LastModified") or info.get("created")
        if hasattr(value, "timestamp"):
            return value.timestamp()
        return float(value) if isinstance(value, int | float) else None


class LocalBackend(Backend):
    """Local disk: fsync everywhere, ``O_DIRECT`` data writes, exclusive create through ``os.link``."""

    kind = "local"
    exclusive = "exact: fsynced temp file, os.link to the final name (EEXIST loses)"

    def open_write(self, path: str, *, direct_io: bool, subfolder: bool, size: int | None = None) -> IO[bytes]:
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

    def create_claim(self, path: str, data: bytes) -> None:
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

    #: At most this many parts per object of a known size (:func:`part_size`).
    parts_per_object = PARTS_PER_OBJECT

    def open_write(self, path: str, *, direct_io: bool, subfolder: bool, size: int | None = None) -> IO[bytes]:
        # s3fs uploads one part per block: the block size is the part size (and the memory one stream buffers).
        return self.fs.open(path, "wb", block_size=part_size(size, self.block_size, parts=self.parts_per_object))

    def _exclusive(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise
        except OSError as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                raise FileExistsError(path) from exc
            raise

    def _claim(self, path: str, data: bytes) -> None:
        self._exclusive(path, data)

    def open_read(self, path: str, stat: dict[str, Any]) -> IO[bytes]:
        # The HEAD just taken, not a second one: its size, and its ETag, which s3fs compares with the GET's (an
        # object replaced since the HEAD fails the read instead of being checked against the old size).
        f = self.fs.open(path, "rb", size=stat["size"])
        f.details = stat
        return f

    def remove_folder_if_empty(self, path: str) -> None:
        return

    def missing_root_error(self, root: str) -> str | None:
        bucket = root.split("/", 1)[0]
        try:
            self.fs.call_s3("head_bucket", Bucket=bucket)  # one request, however large the bucket
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


# How to install the fsspec backend of a scheme: this package's extra where it has one, else the backend itself.
_INSTALL = {
    "s3": "pip install 'lightning_async_ckpt[s3]'",
    "s3a": "pip install 'lightning_async_ckpt[s3]'",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
}


def open_filesystem(uri: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of ``uri`` (local paths: a :class:`RegularLocalFileSystem`).

    Raises:
        ConfigError: Unknown scheme, a backend that is not installed (names what to install), or bad options.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    hint = _INSTALL.get(scheme) or f"install the fsspec backend for {scheme!r}"
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(f"uri {uri!r} needs an fsspec backend that is not installed: {hint} ({exc})") from exc
    except ValueError as exc:
        raise ConfigError(
            f"uri {uri!r} has unknown scheme {scheme!r}; use a local path, file://, memory://, s3:// or another "
            "fsspec protocol"
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        raise ConfigError(f"uri {uri!r} needs an fsspec backend that is not installed: {hint} ({exc})") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"could not open {uri!r} with storage_options {sorted(options)}: {exc}") from exc
    if type(fs) is LocalFileSystem:
        fs = RegularLocalFileSystem(**fs.storage_options)  # never opens a FIFO, socket or device
    return fs, path
