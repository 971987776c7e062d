"""Low-level I/O shared by the writer, the reader and the integrations.

Checksums, the direct-I/O local file, the atomic and exclusive local writes, ``fsync_dir`` and the one loop that
reads an object back while checking its size and checksum (:func:`read_verified`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import uuid
import zlib
from typing import IO, Any

from lightning_async_ckpt.errors import ConfigError, ManifestError
from lightning_async_ckpt.storage.crc import DEFAULT_CHECKSUM, crc32c_combine, crc32c_in_place, crc32c_module
from lightning_async_ckpt.storage.direct import DirectFile

__all__ = [
    "DEFAULT_CHECKSUM",
    "READ_CHUNK",
    "Checksum",
    "ChecksumWriter",
    "DirectFile",
    "Discard",
    "WriteOnlyStream",
    "atomic_local_write",
    "checksum_algorithm",
    "crc32c_combine",
    "crc32c_in_place",
    "exclusive_local_write",
    "file_identity",
    "fsync_dir",
    "open_local_write",
    "read_verified",
    "same_file",
]

READ_CHUNK = 8 << 20


def checksum_algorithm(checksum: str) -> str:
    """The algorithm part of a ``"<algorithm>:<hex>"`` checksum."""
    return checksum.split(":", 1)[0]


class Checksum:
    """Incremental checksum.

    ``crc32c`` (the default where the ``crc32c`` package is installed) runs at several GB/s, so checksumming keeps
    up with disk bandwidth; ``crc32`` (zlib) is the fallback; ``sha256`` is available for stronger verification.

    Args:
        algorithm: ``"crc32c"``, ``"crc32"`` or ``"sha256"``.

    Raises:
        ConfigError: another algorithm, or ``crc32c`` without the ``crc32c`` package.
    """

    def __init__(self, algorithm: str) -> None:
        if algorithm not in ("crc32c", "crc32", "sha256"):
            raise ConfigError(f"checksum must be 'crc32c', 'crc32' or 'sha256', got {algorithm!r}")
        self.algorithm = algorithm
        self._value = 0
        self._sha = hashlib.sha256() if algorithm == "sha256" else None
        self._crc32c = crc32c_module() if algorithm == "crc32c" else None
        if algorithm == "crc32c" and self._crc32c is None:
            raise ConfigError("checksum 'crc32c' needs the google-crc32c package: pip install google-crc32c")

    def update(self, data: bytes | memoryview) -> None:
        """Add ``data`` to the running checksum."""
        if self._sha is not None:
            self._sha.update(data)
        elif self._crc32c is not None:
            self._value = self._crc32c.crc32c(data, self._value)
        else:
            self._value = zlib.crc32(data, self._value)

    def extend(self, data: bytes | memoryview, crc32c: int | None) -> None:
        """Add ``data``, whose CRC-32C the caller already computed (``None``: not known): with this checksum's
        algorithm CRC-32C, the bytes are not read again; with another, they are."""
        if crc32c is None or self.algorithm != "crc32c":
            self.update(data)
        else:
            self._value = crc32c_combine(self._value, crc32c, len(data))

    def hexdigest(self) -> str:
        """``"<algorithm>:<hex digest>"``, the form manifests record."""
        if self._sha is not None:
            return f"sha256:{self._sha.hexdigest()}"
        return f"{self.algorithm}:{self._value:08x}"


def open_local_write(path: str, direct_io: bool) -> IO[bytes] | DirectFile:
    """Create a local file exclusively for writing, with ``O_DIRECT`` when asked and the filesystem supports it.

    Never opens an existing file: truncating a path in place would keep its inode, so another attempt still
    holding a descriptor on it (a stalled writer) could later write into this attempt's bytes. A caller that
    replaces a file unlinks it first; the old descriptor then writes to an orphaned inode.

    Raises:
        FileExistsError: ``path`` exists (nothing was changed).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    if direct_io and hasattr(os, "O_DIRECT"):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem (tmpfs, ...) has no direct I/O
                os.close(fd)
                raise
        else:
            return DirectFile(fd)
    return os.fdopen(fd, "wb")


def file_identity(raw: Any) -> tuple[int, int] | None:
    """``(device, inode)`` of an open local file, or ``None`` when ``raw`` is not one."""
    try:
        st = os.fstat(raw.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def same_file(path: str, identity: tuple[int, int] | None) -> bool:
    """Whether ``path`` is still the file of ``identity`` (see :func:`file_identity`)."""
    if identity is None:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity


def fsync_dir(folder: str) -> None:
    """fsync a local directory, so entries created or removed in it are durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(path: str, data: bytes) -> str:
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmp


def atomic_local_write(path: str, data: bytes) -> None:
    """Replace ``path`` atomically: temp file in the same folder, fsync, ``os.replace``, fsync the folder."""
    tmp = _write_tmp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def exclusive_local_write(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` only if it does not exist, atomically and durably.

    The bytes are written and fsynced under a temporary name, then ``os.link``-ed to ``path``: the link fails
    with ``EEXIST`` when ``path`` exists, so of two writers exactly one wins, and a reader never sees a partial
    file.

    Raises:
        FileExistsError: ``path`` already exists (nothing was changed).
    """
    folder = os.path.dirname(path)
    tmp = _write_tmp(path, data)
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
    fsync_dir(folder)


def read_verified(
    fs: Any,
    path: str,
    entry_or_size: Any,
    checksum: str | None = None,
    *,
    into: Any = None,
    max_bytes: int | None = None,
    opener: Any = None,
) -> bytes | None:
    """Read one object once, checking its size and checksum as the bytes pass.

    Args:
        fs: The fsspec filesystem.
        path: The object's path on ``fs``.
        entry_or_size: An :class:`~lightning_async_ckpt.storage.manifest.ObjectEntry` (its ``size`` and
            ``checksum`` are used) or the expected size in bytes.
        checksum: Expected ``"<algorithm>:<hex>"`` when ``entry_or_size`` is a size; ``None`` checks size only.
        into: A writable file-like object that receives every chunk (e.g. a local copy); then nothing is kept in
            memory and ``None`` is returned. Each chunk is a view of a buffer the next chunk overwrites: ``write``
            must copy or consume it before it returns (as files do).
        max_bytes: Refuse (before reading) an object larger than this when collecting into memory.
        opener: Opens ``path`` for reading (default ``fs.open(path, "rb")``); a backend's ``open_read`` when the
            size was just checked.

    Returns:
        The bytes, or ``None`` when ``into`` is given.

    Raises:
        ManifestError: The object's size or checksum differs from what was expected (the message names both).
        OSError: The object cannot be read (``FileNotFoundError`` when it is missing).
    """
    if isinstance(entry_or_size, int):
        size, expected = entry_or_size, checksum
    else:
        size, expected = entry_or_size.size, checksum or entry_or_size.checksum
    if into is None and max_bytes is not None and size > max_bytes:
        raise ManifestError(f"{path}: {size} bytes is more than the {max_bytes} bytes allowed here")
    digest = Checksum(checksum_algorithm(expected)) if expected else None
    parts: list[bytes] = []
    got = 0
    with opener() if opener is not None else fs.open(path, "rb") as f:
        for chunk in _chunks(f, reuse=into is not None):
            got += len(chunk)
            if got > size:
                raise ManifestError(f"{path}: more than the {size} bytes its manifest lists")
            if digest is not None:
                digest.update(chunk)
            if into is not None:
                into.write(chunk)
            else:
                parts.append(chunk)
    if got != size:
        raise ManifestError(f"{path}: read {got} bytes, manifest says {size}")
    if digest is not None and digest.hexdigest() != expected:
        raise ManifestError(f"{path}: checksum {digest.hexdigest()}, manifest says {expected}")
    return None if into is not None else b"".join(parts)


def _chunks(f: Any, *, reuse: bool) -> Any:
    """The bytes of open file ``f`` in chunks of up to :data:`READ_CHUNK`; with ``reuse``, views of one buffer that
    each next chunk overwrites (no new buffer per chunk; a peer replica's sender puts these views on the wire as
    they are), else new ``bytes``."""
    readinto = getattr(f, "readinto", None) if reuse else None
    if readinto is None:
        while chunk := f.read(READ_CHUNK):
            yield chunk
        return
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    while n := readinto(view):
        yield view[:n]


class Discard:
    """A sink for :func:`read_verified` that keeps nothing: the check reads every byte once."""

    def write(self, data: bytes | memoryview) -> int:
        return len(data)


class WriteOnlyStream:
    """The file-object answers every write-only object stream gives (``torch.save`` and zip writers ask them).

    Subclasses implement ``write``, ``flush`` and ``close``; ``tell`` returns ``self.size`` (bytes written so far)
    unless overridden.
    """

    size: int = 0

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size


class ChecksumWriter(WriteOnlyStream):
    """A write-only stream that counts and checksums every byte on its way to ``raw``."""

    def __init__(self, raw: Any, algorithm: str) -> None:
        self.raw = raw
        self.digest = Checksum(algorithm)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        return self.count(view)

    def count(self, view: memoryview, crc32c: int | None = None) -> int:
        """Add ``view`` (just written) to the size and the checksum; returns its length. ``crc32c``: the CRC-32C of
        ``view`` when the caller computed it from these very bytes (:meth:`Checksum.extend`)."""
        self.digest.extend(view, crc32c)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.raw.flush()

    @property
    def checksum(self) -> str:
        """``"<algorithm>:<hex>"`` of the bytes written so far."""
        return self.digest.hexdigest()
