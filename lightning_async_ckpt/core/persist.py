"""Persist: serialize a staged snapshot into a generation, with a retry policy, and stop cleanly when abandoned.

The serializer (``torch.save`` by default) runs on the upload thread, but its writes do not touch storage there:
each chunk goes to the engine's I/O thread through a :class:`PumpedStream`. ``torch.save`` calls ``write`` from
inside C++ frames; if that thread were blocked in storage when the interpreter finalizes, waking up would kill
it inside those frames (SIGABRT). With the pump, the upload thread only ever waits on the pump, which answers an
abandon at once, so ``torch.save`` unwinds normally and the thread can be joined before finalization. Chunks are
either views of the staged buffers (kept alive by the pump until written) or copied, so an abandoned write never
reads memory that was freed behind it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_async_ckpt.core.workers import Worker
from lightning_async_ckpt.errors import (
    CheckpointError,
    ConfigError,
    GenerationExistsError,
    ManifestError,
    StorageError,
    TornSnapshotError,
)
from lightning_async_ckpt.storage.io import WriteOnlyStream

if TYPE_CHECKING:
    from lightning_async_ckpt.core.interfaces import GenerationSink, SaveTarget

__all__ = ["AbandonedError", "PumpedStream", "RetryPolicy"]

_log = logging.getLogger("lightning_async_ckpt")
# Small chunks (pickle data, zip headers) are copied and coalesced into blocks of this size.
_BLOCK = 1 << 20
# How often a waiting upload thread looks at the abandon flag.
_POLL_S = 0.05


class AbandonedError(CheckpointError):
    """The save was abandoned (``close`` timed out or ``abandon=True``); no manifest was written."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Which upload failures are retried, how often, and after what delay.

    Attributes:
        retries: Extra attempts after the first.
        backoff_s: Delay before the first retry; doubles per attempt.
    """

    retries: int = 2
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {self.retries!r}")
        if not isinstance(self.backoff_s, int | float) or not 0 <= self.backoff_s < float("inf"):
            raise ConfigError(f"retry_backoff_s must be a finite number >= 0, got {self.backoff_s!r}")

    @staticmethod
    def is_transient(exc: BaseException) -> bool:
        """Whether ``exc`` may succeed on another attempt (storage faults, timeouts; never usage errors).

        ``ValueError`` (config and writer-misuse errors), an existing generation, a bad manifest, a torn
        snapshot and a full disk (``ENOSPC`` anywhere in the cause chain) are not retried.
        """
        if isinstance(exc, ValueError | TypeError | GenerationExistsError | ManifestError | TornSnapshotError):
            return False
        if isinstance(exc, AbandonedError):
            return False
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                return False
            cause = cause.__cause__
        return isinstance(exc, OSError | StorageError | TimeoutError | ConnectionError)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based): the doubling backoff plus up to half again.

        The random part spreads the retries of many writers throttled at once (every rank of a job hitting one
        object-store prefix gets ``503 SlowDown`` together) instead of sending them back in lockstep.
        """
        base = self.backoff_s * (2 ** (attempt - 1))
        return base * (1.0 + 0.5 * random.random())

    def should_retry(self, exc: BaseException, attempt: int) -> bool:
        """Whether to try again after ``attempt`` (0-based) failed with ``exc``."""
        return attempt < self.retries and self.is_transient(exc)


class PumpedWriter:
    """A :class:`~lightning_async_ckpt.storage.writer.GenerationWriter` whose object streams write on the I/O thread.

    Args:
        writer: The real writer (``open`` runs on the caller thread; each stream's writes and close on ``io``).
        io: The I/O worker.
        abandon: Set when the save is abandoned.
        owners: The staged buffers; chunks inside them are written without a copy.
        checksums: CRC-32C of staged buffers by address (computed during the staging copy): a chunk that is exactly
            such a buffer is checksummed by the object stream without reading it again.
    """

    def __init__(
        self, writer: Any, io: Worker, abandon: threading.Event, owners: Sequence[torch.Tensor], checksums: Any = None
    ) -> None:
        self._writer = writer
        self._io = io
        self._abandon = abandon
        known, spans = checksums or {}, [(b.data_ptr(), b.numel() * b.element_size(), b) for b in owners if b.numel()]
        self._ranges = sorted(((at, at + n, b, known.get(at)) for at, n, b in spans), key=lambda r: r[0])

    def open(self, name: str) -> PumpedStream:
        """Open object ``name`` (on this thread) and return a stream whose writes run on the I/O thread."""
        if self._abandon.is_set() or self._io.stopping:
            raise AbandonedError("save abandoned before its data was written")
        stream = self._writer.open(name)
        if self._abandon.is_set() or self._io.stopping:  # abandoned while storage was opening the object
            error = AbandonedError("save abandoned before its data was written")
            stream.__exit__(AbandonedError, error, None)
            raise error
        return PumpedStream(stream, self._io, self._abandon, self._ranges)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class PumpedStream(WriteOnlyStream):
    """A write-only stream that forwards chunks to ``stream`` on an I/O thread, in order, with backpressure.

    ``write`` returns once the chunk is queued (at most four chunks are in flight); :meth:`close` waits until
    everything is written and the real stream closed. Any wait gives up with :class:`AbandonedError` as soon as
    ``abandon`` is set; the I/O thread then stops at its next chunk and discards the object.
    """

    def __init__(
        self, stream: Any, io: Worker, abandon: threading.Event, ranges: list[tuple[int, int, Any, int | None]]
    ) -> None:
        self._stream = stream
        self._abandon = abandon
        self._ranges = ranges
        self._starts = [r[0] for r in ranges]
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._block = bytearray()
        self._error: BaseException | None = None
        self._size = 0
        self._closed = False
        self._cancelled = False
        self._done: Future = io.submit(self._drain)

    @property
    def preferred_alignment(self) -> int:
        """The real stream's (:attr:`ObjectStream.preferred_alignment`)."""
        return getattr(self._stream, "preferred_alignment", 1)

    # -- producer side (the serializer's thread) -----------------------------------------------------------
    def write(self, data: Any) -> int:
        """Queue ``data`` for writing; raises the I/O thread's error, or :class:`AbandonedError`."""
        self._check()
        view = memoryview(data)
        if not view.contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        n = len(view)
        if n == 0:
            return 0
        owner, crc = self._owner(view)
        if owner is None:
            self._block += view  # a view of memory the caller may free after we return: copy it
            if len(self._block) >= _BLOCK:
                self._flush_block()
        else:
            self._flush_block()
            self._put((view, owner, crc))
        self._size += n
        return n

    def _owner(self, view: memoryview) -> tuple[Any, int | None]:
        """The staged buffer ``view`` lies in, and its CRC-32C when ``view`` is exactly that whole buffer."""
        if not self._ranges:
            return None, None
        start = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0:
            lo, hi, owner, crc = self._ranges[i]
            if lo <= start and start + len(view) <= hi:
                return owner, crc if (start, start + len(view)) == (lo, hi) else None
        return None, None

    def _flush_block(self) -> None:
        if self._block:
            block, self._block = bytes(self._block), bytearray()
            self._put((memoryview(block), None, None))

    def _put(self, item: Any) -> None:
        while True:
            self._check()
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _check(self) -> None:
        if self._abandon.is_set():
            raise AbandonedError("save abandoned while its data was being written")
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """No-op: data is made durable when the stream closes."""

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        """Write what is queued, close the real stream (making the object durable) and wait for it."""
        if self._closed:
            return
        self._flush_block()
        self._closed = True
        self._put(("close", None, None))
        while True:
            try:
                self._done.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                if self._abandon.is_set():
                    raise AbandonedError("save abandoned while its data was being written") from None
        if self._error is not None:
            raise self._error

    def _cancel(self) -> None:
        if not self._closed:
            self._closed = self._cancelled = True
            # Never blocks: the I/O thread may be stuck in storage; it discards the object when it gets here.
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(("cancel", None, None))

    def __enter__(self) -> PumpedStream:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self._cancel()
        # The serializer saw our write fail and raised its own error about it (torch.save: "unexpected pos");
        # the storage error is the one that names the cause and decides whether a retry may help.
        # Raised as is: `from exc` would overwrite its own cause (the OSError whose errno decides the retry).
        if self._error is not None and exc is not self._error:
            raise self._error

    # -- consumer side (the I/O thread) ------------------------------------------------------------------
    def _drain(self) -> None:
        stream, failed = self._stream, False
        # An object stream that takes a checksum already computed (ObjectStream.write_checksummed) is spared a pass.
        known = getattr(stream, "write_checksummed", None)
        while True:
            try:
                item, owner, crc = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._cancelled or self._abandon.is_set():
                    item, owner, crc = "cancel", None, None
                else:
                    continue
            if isinstance(item, str):
                break
            if failed or self._cancelled or self._abandon.is_set():
                continue
            try:
                if crc is not None and known is not None:
                    known(item, crc)
                else:
                    stream.write(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the producer at its next call
                self._error, failed = exc, True
            del item, owner
        if item == "close" and not failed and not self._abandon.is_set():
            try:
                stream.close()
            except BaseException as exc:  # noqa: BLE001 - handed to the producer waiting in close()
                self._error = exc
            return
        error = self._error or AbandonedError("save abandoned")
        stream.__exit__(type(error), error, None)


def wait_or_abandon(delay: float, abandon: threading.Event) -> bool:
    """Sleep ``delay`` seconds unless abandoned first; returns True when abandoned."""
    return abandon.wait(delay) if delay > 0 else abandon.is_set()


def persist(
    *,
    store: SaveTarget,
    serializer: Any,
    step: int,
    state: Any,
    record: Any,
    policy: RetryPolicy,
    io: Worker,
    abandon: threading.Event,
    buffers: Sequence[torch.Tensor],
    on_uploaded: Callable[[int], None],
    commit: Callable[[Any], Any],
    on_retry: Callable[[int, BaseException], None],
    object_keys: Mapping[str, str] | None = None,
    checksums: Mapping[int, int] | None = None,
) -> Any:
    """Write one generation with retries: serialize through the pump, then ``commit(writer)`` writes the manifest.

    ``object_keys`` maps object names to the file each is written to (:meth:`GenerationWriter.place`);
    ``checksums`` gives the CRC-32C of staged buffers by address (:meth:`StagingJob.staged_checksums`).

    Returns:
        The committed manifest.

    Raises:
        AbandonedError: ``abandon`` was set; nothing was committed.
        BaseException: The last attempt's error (not retried when not transient).
    """
    attempt = 0
    while True:
        if abandon.is_set():
            raise AbandonedError(f"save of step {step} abandoned at close; no manifest was written")
        writer: GenerationSink | None = None
        try:
            t_up = time.time()
            writer = store.begin(step)
            for name, key in (object_keys or {}).items():
                writer.place(name, key)
            serializer.write(state, PumpedWriter(writer, io, abandon, buffers, checksums))
            record.upload_s = time.time() - t_up
            record.bytes = sum(o.size for o in writer.objects)
            record.throughput_bps = record.bytes / record.upload_s if record.upload_s > 0 else None
            record.mark("upload", t_up)
            on_uploaded(record.bytes)
            if abandon.is_set():
                raise AbandonedError(f"save of step {step} abandoned at close; no manifest was written")
            t_commit = time.time()
            manifest = commit(writer)
            record.commit_s = time.time() - t_commit
            record.mark("commit", t_commit)
            return manifest
        except BaseException as exc:
            if writer is not None:
                # On the I/O thread, after the object it may still be writing: never two threads in one writer.
                # An abandoned save does not wait for it (storage may hang); a failed attempt does.
                aborted = io.submit(writer.abort)
                while not abandon.is_set():
                    try:
                        aborted.result(timeout=_POLL_S)
                        break
                    except FutureTimeout:
                        continue
                    except Exception:  # noqa: BLE001 - aborting is best effort; the attempt's error decides
                        break
            if attempt > 0 and isinstance(exc, GenerationExistsError):
                # Attempt 0 found no manifest, so one found now is an earlier attempt's PUT that landed although
                # its acknowledgement was lost: the generation is committed, not failed.
                landed = _own_commit(store, step)
                if landed is not None:
                    return landed
            if abandon.is_set() and not isinstance(exc, AbandonedError):
                raise AbandonedError(f"save of step {step} abandoned at close; no manifest was written") from exc
            if not policy.should_retry(exc, attempt):
                raise
            attempt += 1
            delay = policy.delay(attempt)
            _log.warning("save of step %d failed (%s); retry %d in %.2fs", step, exc, attempt, delay)
            on_retry(attempt, exc)
            if wait_or_abandon(delay, abandon):
                raise AbandonedError(f"save of step {step} abandoned at close") from exc


def _own_commit(store: SaveTarget, step: int) -> Any:
    try:
        manifest = store.manifest(step)
    except ManifestError:
        return None
    if manifest.run_id != store.run_id or store.check_sizes(manifest):
        return None
    return manifest
