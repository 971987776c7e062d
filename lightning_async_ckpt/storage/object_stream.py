"""One data object of a generation being written: a checksummed, counted, write-only stream.

Closing it makes the object durable before it is recorded in the generation; an object whose write failed is never
recorded, and the storage error (not a serializer's wrapper of it) decides retries.
"""

from __future__ import annotations

import logging
from typing import IO, TYPE_CHECKING, Any, Protocol

from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.storage.io import ChecksumWriter
from lightning_async_ckpt.storage.manifest import ObjectEntry

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.view import StoreView

__all__ = ["ObjectStream"]

_log = logging.getLogger("lightning_async_ckpt.storage.writer")


class StreamOwner(Protocol):
    """What a stream needs of the :class:`~.writer.GenerationWriter` that opened it."""

    store: StoreView
    path: str
    checksum: str

    def renew(self) -> None: ...

    def key_of(self, name: str) -> str: ...

    def _record(self, entry: ObjectEntry) -> None: ...

    def _discard(self, name: str, *, partial: bool = False) -> None: ...


class ObjectStream(ChecksumWriter):
    """A writable stream for one data object: counts and checksums bytes as they pass, holds none whole."""

    def __init__(self, writer: StreamOwner, name: str, raw: IO[bytes]) -> None:
        super().__init__(raw, writer.checksum)
        self._writer = writer
        self.name = name
        self.closed = False
        self.failure: StorageError | None = None

    @property
    def preferred_alignment(self) -> int:
        """The alignment of file offsets and memory that large writes go to storage best from (1: any)."""
        return getattr(self.raw, "preferred_alignment", 1)

    def write(self, data: Any) -> int:
        """Write ``data``; a storage failure is kept so it, not a serializer's wrapper, decides retries."""
        return self.write_checksummed(data, None)

    def write_checksummed(self, data: Any, crc32c: int | None) -> int:
        """:meth:`write` of ``data`` whose CRC-32C the caller computed from these very bytes (``None``: unknown):
        with the object's checksum CRC-32C, they are not read again to checksum them."""
        view = memoryview(data).cast("B")
        try:
            self.raw.write(view)
        except Exception as exc:
            self.failure = StorageError(f"could not write object {self.name!r} of {self._writer.path}: {exc}")
            raise self.failure from exc
        n = self.count(view, crc32c)
        self._writer.renew()
        return n

    def close(self) -> None:
        """Make the object durable and record it in the generation; idempotent."""
        if self.closed:
            return
        if self.failure is not None:
            # A write failed but the serializer carried on: the object is incomplete, never record it.
            self.abandon()
            raise self.failure
        self.closed = True
        try:
            self._writer.store.backend.finish(self.raw)
        except Exception as exc:
            self._writer._discard(self.name)
            raise StorageError(f"could not finish object {self.name!r} of {self._writer.path}: {exc}") from exc
        entry = ObjectEntry(name=self.name, size=self.size, checksum=self.checksum)
        key = self._writer.key_of(self.name)
        if key != self.name:
            entry = ObjectEntry(**{**entry.__dict__, "path": key})
        self._writer._record(entry)

    def abandon(self) -> None:
        """Close without recording or publishing (after a failed write; aborts a multipart upload)."""
        if not self.closed:
            self.closed = True
            try:
                self._writer.store.backend.discard(self.raw)
            except Exception:  # noqa: BLE001 - the write already failed; its error is the one that matters
                _log.debug("closing abandoned object %s failed", self.name, exc_info=True)
            self._writer._discard(self.name, partial=True)

    def __enter__(self) -> ObjectStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()
            if self.failure is not None and exc is not self.failure:
                raise self.failure
