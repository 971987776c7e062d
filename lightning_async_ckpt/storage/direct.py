"""A write-only local file that bypasses the page cache (``O_DIRECT``), with the disk kept busy.

The caller fills one aligned buffer while a writer thread writes the previous ones, so copy and checksum never leave
the disk idle. The aligned buffers are kept between files, process-wide (up to :data:`_DEPTH`), until
:func:`release_buffers`: a fresh mapping costs tens of milliseconds of page faults.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import queue
import threading
from typing import Any

import numpy as np

__all__ = ["DIRECT_ALIGN", "DirectFile", "cached_buffer_bytes", "release_buffers"]

DIRECT_ALIGN = 4096
# Each write is one buffer: large, so that the writer thread takes the GIL back rarely per byte.
_BUFFER = 32 << 20
_DEPTH = 3
# A copy smaller than this is done with the GIL held (numpy's GIL release costs more than it saves).
_SMALL = 64 << 10
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
# An aligned span at least this large is written from the caller's memory (smaller ones are cheaper to copy).
_IN_PLACE = 1 << 20


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0] if len(view) else 0


class _BufferCache:
    """Free aligned buffers (each with its numpy view) shared by the files of this process."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: list[tuple[mmap.mmap, np.ndarray]] = []

    def take(self, size: int) -> tuple[mmap.mmap, np.ndarray]:
        with self._lock:
            for i, (buf, _) in enumerate(self._free):
                if len(buf) == size:
                    return self._free.pop(i)
        # Page-aligned, as O_DIRECT requires; private, so a forked child never shares a kept buffer's pages.
        buf = mmap.mmap(-1, size, flags=_PRIVATE)
        return buf, np.frombuffer(buf, dtype=np.uint8)

    def give(self, entries: list[tuple[mmap.mmap, np.ndarray]]) -> None:
        with self._lock:
            keep = max(0, self._keep - len(self._free))
            self._free.extend(entries[:keep])
            extra = entries[keep:]
        # The caller's list still holds each (buffer, view): emptied here, so the views' last references are
        # the ones _close drops (a left view made close() raise "BufferError: cannot close exported pointers").
        entries.clear()
        _close(extra)

    def clear(self) -> None:
        with self._lock:
            entries, self._free = self._free, []
        _close(entries)

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(buf) for buf, _ in self._free)


def _close(entries: list[tuple[mmap.mmap, np.ndarray]]) -> None:
    while entries:
        buf, view = entries.pop()
        del view  # the last export of the mapping: close() refuses while a view exists
        buf.close()


_CACHE = _BufferCache(_DEPTH)


def release_buffers() -> None:
    """Unmap the aligned write buffers kept between files (called when a checkpointer closes)."""
    _CACHE.clear()


def cached_buffer_bytes() -> int:
    """Bytes of aligned write buffers kept between files right now."""
    return _CACHE.nbytes()


class DirectFile:
    """Buffered ``O_DIRECT`` writes through :data:`_DEPTH` aligned buffers and one writer thread.

    A write error on the writer thread is raised by the next :meth:`write` or :meth:`flush`. The unaligned tail is
    written after clearing ``O_DIRECT``. ``fsync`` is the caller's (the file's metadata still needs it).

    Args:
        fd: A file descriptor opened with ``O_DIRECT``; owned (closed) by this object.
        buffer_bytes: Size of each aligned buffer (a multiple of :data:`DIRECT_ALIGN`).
    """

    def __init__(self, fd: int, buffer_bytes: int = _BUFFER) -> None:
        self._fd = fd
        self._size = buffer_bytes - buffer_bytes % DIRECT_ALIGN
        self._maps: list[tuple[mmap.mmap, np.ndarray]] = []  # each buffer with its numpy view
        self._views: dict[int, np.ndarray] = {}
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._todo: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cur: mmap.mmap | None = None
        self._cur_np: np.ndarray | None = None
        self._fill = 0
        self._direct = True
        self.closed = False
        self.in_place_bytes = 0  # bytes written from the caller's memory, without a copy

    #: The file offset and memory alignment that lets :meth:`write` send bytes to the disk without a copy.
    preferred_alignment = DIRECT_ALIGN

    # -- caller side -------------------------------------------------------------------------------------
    def write(self, data: Any) -> int:
        """Copy ``data`` into the current buffer; full buffers go to the writer thread.

        A large ``data`` whose memory and file offset are both :data:`DIRECT_ALIGN`-aligned (a staged storage of a
        checkpoint serialized with that alignment) is written from its own memory instead, after the buffers queued
        before it, and only its unaligned tail is copied: one pass over the bytes less. Either way ``data`` is no
        longer used once this returns.
        """
        self._raise_error()
        view = memoryview(data).cast("B")
        total = len(view)
        aligned = total - total % DIRECT_ALIGN
        if (
            aligned >= _IN_PLACE
            and self._direct
            and self._fill % DIRECT_ALIGN == 0
            and _address(view) % DIRECT_ALIGN == 0
        ):
            self._write_in_place(view[:aligned])
            view = view[aligned:]
        self._copy(view)
        return total

    def _write_in_place(self, span: memoryview) -> None:
        if self._cur is not None and self._fill:
            self._submit(self._fill)  # the bytes before it, in order (an aligned amount: checked by the caller)
        self._todo.join()
        self._raise_error()
        done = 0
        while done < len(span):  # releases the GIL; the disk reads the caller's memory
            done += os.write(self._fd, span[done:])
        self.in_place_bytes += done

    def _copy(self, view: memoryview) -> None:
        total = len(view)
        src = np.frombuffer(view, dtype=np.uint8) if total >= _SMALL else None
        pos = 0
        while pos < total:
            if self._cur is None:
                self._take_buffer()
            n = min(total - pos, self._size - self._fill)
            if src is not None:
                np.copyto(self._cur_np[self._fill : self._fill + n], src[pos : pos + n])  # type: ignore[index]
            else:
                self._cur[self._fill : self._fill + n] = view[pos : pos + n]  # type: ignore[index]
            self._fill += n
            pos += n
            if self._fill == self._size:
                self._submit(self._size)

    def flush(self) -> None:
        """Write everything: the aligned part directly, the tail through the page cache; waits for the disk."""
        tail = b""
        if self._cur is not None:
            aligned = self._fill - self._fill % DIRECT_ALIGN
            tail = bytes(self._cur[aligned : self._fill])
            if aligned:
                self._submit(aligned)
            else:
                self._free.put(self._cur)
                self._cur, self._cur_np, self._fill = None, None, 0
        self._todo.join()
        self._raise_error()
        if tail:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self._direct = False  # the offset is unaligned from here on: later bytes are copied, as before
            os.write(self._fd, tail)

    def fileno(self) -> int:
        """The underlying file descriptor."""
        return self._fd

    def close(self) -> None:
        """Stop the writer thread, return the buffers to the cache and close the descriptor (:meth:`flush` first)."""
        if self.closed:
            return
        self.closed = True
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
        self._cur = self._cur_np = None
        self._views.clear()
        maps, self._maps = self._maps, []
        _CACHE.give(maps)
        os.close(self._fd)

    def _take_buffer(self) -> None:
        if len(self._maps) < _DEPTH and self._free.empty():
            buf, view = _CACHE.take(self._size)
            self._maps.append((buf, view))
            self._views[id(buf)] = view
        else:
            buf = self._free.get()
            self._raise_error()
        self._cur, self._fill = buf, 0
        self._cur_np = self._views[id(buf)]

    def _submit(self, nbytes: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning-async-ckpt-direct", daemon=True)
            self._thread.start()
        self._todo.put((self._cur, nbytes))  # type: ignore[arg-type]
        self._cur, self._cur_np, self._fill = None, None, 0

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # -- writer thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                self._todo.task_done()
                return
            buf, nbytes = item
            try:
                if self._error is None:
                    view = memoryview(buf)
                    done = 0
                    while done < nbytes:
                        done += os.write(self._fd, view[done:nbytes])
                    view.release()
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's next write or flush
                self._error = exc
            finally:
                self._free.put(buf)
                self._todo.task_done()
