"""Kernel write tracking of host memory: the exact guard's cut without reading the deferred bytes.

The exact guard must know whether any deferred byte changed between the cut and its staging copy. Reading every
byte at the cut (a fingerprint) costs about one memory pass on the training thread. Linux (6.7 and later) can
answer the same question for page-aligned memory without reading it: a ``userfaultfd`` registered with
asynchronous write protection (``UFFD_FEATURE_WP_ASYNC``) lets the cut write-protect the pages (a page-table walk),
the kernel resolves a later write by itself (no handler thread, no signal) and clears the page's protection, and
``PAGEMAP_SCAN`` on ``/proc/self/pagemap`` reports the pages written since. Every write through the page tables is
seen: the training thread, other threads, numpy views, ``.data``, raw pointers, and the kernel writing into the
memory on the process's behalf (``read``/``recv`` into a tensor). Not seen: a device writing by DMA into memory it
pinned long before the cut, which is why pinned and shared storages are never tracked (the guard fingerprints
them).

:class:`WriteTracker` is one per process (re-created after ``fork``: a child has its own page tables). It only
tracks ranges no other session tracks (a second overlapping request is refused and the guard fingerprints), and it
proves itself on this kernel before the first use: a self-test must see exactly the page it wrote. Anything else
(no ``userfaultfd``, no asynchronous protection, no ``PAGEMAP_SCAN``, another architecture, a failed self-test, or
``LAC_WRITE_TRACKING=0``) makes :func:`tracker` return ``None`` and the guard fingerprint as before.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import re
import struct
import sys
import threading
from collections.abc import Collection, Sequence

from lightning_async_ckpt.core import uffd_calls

__all__ = ["PAGE", "WriteTracker", "page_interior", "tracker"]

_log = logging.getLogger("lightning_async_ckpt")

PAGE = mmap.PAGESIZE
_SYSCALL = {"x86_64": 323, "aarch64": 282}  # userfaultfd(2)
_UFFD_USER_MODE_ONLY = 1
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_UNREGISTER = 0x8010AA01  # _IOR(0xAA, 0x01, struct uffdio_range)
_REGISTER_MODE_WP = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


def page_interior(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: ``(start, end)``, empty when ``start >= end``."""
    start = -(-address // PAGE) * PAGE
    return start, (address + nbytes) // PAGE * PAGE


class WriteTracker:
    """Write-protects page ranges and reports whether they were written since (one per process).

    Thread-safety: every method takes the tracker's lock; a range is tracked by one session at a time. Every method
    is a no-op (or refuses) in a process other than the one that opened it: a forked child inherits the descriptors,
    which would act on the parent's memory.

    Args:
        uffd: A ``userfaultfd`` descriptor after its ``UFFDIO_API`` handshake with asynchronous write protection.
        pagemap: A descriptor of ``/proc/self/pagemap`` opened by this process.
    """

    def __init__(self, uffd: int, pagemap: int) -> None:
        self.pid = os.getpid()
        self._uffd = uffd
        self._pagemap = pagemap
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}  # start -> end of every protected (and registered) range
        self._region = (_Region * 1)()
        self._warned = False

    def protect_all(self, ranges: Sequence[tuple[int, int]], anonymous: Collection[tuple[int, int]] = ()) -> list[bool]:
        """Register and write-protect each page-aligned ``(start, end)``; per range, whether it is tracked.

        A range is refused (the caller fingerprints it) when: it overlaps a range tracked now (that session's scan
        would be reset); it is not private anonymous memory (a shared or file mapping changes without a write through
        this process's page tables); another ``userfaultfd`` registered it (``EBUSY``: never protect another's
        memory); or the process holds descriptors through which devices or the kernel write memory without a fault
        (an ``io_uring``, RDMA verbs, VFIO: then every range is refused). One read of ``/proc/self/maps`` serves every
        range; none where every range is in ``anonymous`` (ranges this tracker accepted before whose memory the
        caller knows is the same allocation since: a storage kept alive cannot have been mapped again).
        """
        if os.getpid() != self.pid or not ranges:
            return [False] * len(ranges)
        with self._lock:
            if _pinned_writers():
                if not self._warned:
                    self._warned = True
                    _log.info("exact guard: fingerprinting (an io_uring, RDMA or VFIO user can write memory unseen)")
                return [False] * len(ranges)
            spans = [] if all(r in anonymous for r in ranges) else _anonymous_private_spans()
            registered = [
                start < end
                and start % PAGE == 0
                and end % PAGE == 0
                and not any(s < end and start < e for s, e in self._active.items())
                and ((start, end) in anonymous or _covered(spans, start, end))
                and self._register(start, end)
                for start, end in ranges
            ]
            chosen = [r for r, ok in zip(ranges, registered, strict=True) if ok]
            failed = uffd_calls.write_protect(self._pagemap, chosen)  # the page-table walks
            for start, end in chosen:
                if (start, end) in failed:
                    self._disarm(start, end)
                else:
                    self._active[start] = end
            return [ok and r not in failed for r, ok in zip(ranges, registered, strict=True)]

    def protect(self, start: int, end: int) -> bool:
        """:meth:`protect_all` of one range."""
        return self.protect_all([(start, end)])[0]

    def written(self, start: int, end: int) -> bool:
        """Whether any page of the tracked ``[start, end)`` was written since it was protected.

        Raises:
            OSError: The kernel could not scan the range, the range is not tracked, or this is another process (the
                caller refuses the snapshot: it cannot prove it).
        """
        if os.getpid() != self.pid:
            raise OSError(errno.EPERM, "write tracking belongs to another process (forked)")
        with self._lock:
            if self._active.get(start) != end:
                raise OSError(errno.ENOENT, "range not tracked")
            region = ctypes.addressof(self._region)
            flags, written = uffd_calls.PM_SCAN_CHECK_WPASYNC, _PAGE_IS_WRITTEN
            # One output region at most: any written page answers.
            args = (96, flags, start, end, 0, region, 1, 0, 0, written, 0, written)
            return uffd_calls.ioctl(self._pagemap, uffd_calls.PAGEMAP_SCAN, *args) > 0

    def release(self, start: int, end: int) -> None:
        """Stop tracking ``[start, end)``: lift the protection (later writes, the optimizer's, take no fault) and
        unregister the range (its mappings merge back)."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            if self._active.pop(start, None) is not None:
                self._disarm(start, end)

    @property
    def active(self) -> int:
        """How many ranges are tracked now."""
        with self._lock:
            return len(self._active)

    def _register(self, start: int, end: int) -> bool:
        try:  # EBUSY when another userfaultfd owns the range
            uffd_calls.ioctl(self._uffd, _UFFDIO_REGISTER, start, end - start, _REGISTER_MODE_WP, 0)
        except OSError:
            return False
        return True

    def _disarm(self, start: int, end: int) -> None:
        try:  # unregistering lifts the protection too (one page-table walk)
            uffd_calls.ioctl(self._uffd, _UFFDIO_UNREGISTER, start, end - start)
        except OSError:  # unmapped since (the storage was freed): nothing left
            pass


# A private mapping with no file (inode 0) and no name, or the heap, the stack, a named anonymous mapping.
_ANONYMOUS_PRIVATE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) [r-][w-][x-]p [0-9a-f]+ [0-9a-f]+:[0-9a-f]+ 0[ \t]*(?:\[heap\]|\[stack\]|\[anon:[^\]\n]*\])?$",
    re.MULTILINE,
)


def _anonymous_private_spans() -> list[tuple[int, int]]:
    """The address spans ``/proc/self/maps`` shows private and anonymous, merged (empty when it cannot be read)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            text = maps.read()
    except OSError:
        return []
    spans: list[tuple[int, int]] = []
    for low_hex, high_hex in _ANONYMOUS_PRIVATE.findall(text):
        low, high = int(low_hex, 16), int(high_hex, 16)
        if spans and spans[-1][1] == low:
            spans[-1] = (spans[-1][0], high)
        else:
            spans.append((low, high))
    return spans


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether one span of ``spans`` (sorted, merged) contains ``[start, end)``."""
    index = bisect.bisect_right(spans, (start, float("inf"))) - 1
    return index >= 0 and spans[index][0] <= start and end <= spans[index][1]


_PINNED_WRITER_LINKS = ("anon_inode:[io_uring]", "/dev/infiniband/", "/dev/vfio/")


def _pinned_writers() -> bool:
    """Whether this process holds a descriptor through which devices or the kernel may write its memory without a
    page fault (io_uring registered buffers, RDMA verbs, VFIO)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return True
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith(_PINNED_WRITER_LINKS):
            return True
    return False


_lock = threading.Lock()
_tracker: WriteTracker | None = None
_checked_pid: int | None = None


def tracker() -> WriteTracker | None:
    """This process's tracker, or ``None`` where the kernel cannot track writes (the guard fingerprints)."""
    global _tracker, _checked_pid
    pid = os.getpid()
    if _checked_pid == pid:
        return _tracker
    with _lock:
        if _checked_pid != pid:  # first use, or a forked child: its own descriptors and page tables
            _tracker, _checked_pid = _open(), pid
            if _tracker is not None:
                _log.debug("exact guard: kernel write tracking (userfaultfd asynchronous write protection)")
        return _tracker


def _open() -> WriteTracker | None:
    if os.environ.get("LAC_WRITE_TRACKING", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    number = _SYSCALL.get(platform.machine())
    if number is None:
        return None
    uffd_calls.load()
    libc = ctypes.CDLL(None, use_errno=True)
    uffd = libc.syscall(number, os.O_CLOEXEC | _UFFD_USER_MODE_ONLY)
    if uffd < 0:
        return None
    pagemap = -1
    try:
        wanted = _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED
        api = bytearray(struct.pack("QQQ", 0xAA, wanted, 0))
        fcntl.ioctl(uffd, _UFFDIO_API, api)
        if struct.unpack("QQQ", api)[1] & wanted != wanted:
            raise OSError(errno.ENOTSUP, "no asynchronous write protection")
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        candidate = WriteTracker(uffd, pagemap)
        if _self_test(candidate):
            return candidate
    except OSError:
        pass
    os.close(uffd)
    if pagemap >= 0:
        os.close(pagemap)
    return None


def _self_test(candidate: WriteTracker) -> bool:
    """Protect three fresh pages, write the middle one: the tracker must see that write and only it."""
    area = mmap.mmap(-1, 3 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = (ctypes.c_char * (3 * PAGE)).from_buffer(area)
        base = ctypes.addressof(view)
        del view  # the address stays valid while the mapping is open
        area[:] = b"\x01" * (3 * PAGE)
        pages = [(base + i * PAGE, base + (i + 1) * PAGE) for i in range(3)]
        if not all(candidate.protect_all(pages)):
            return False
        try:
            clean = not any(candidate.written(*page) for page in pages)
            area[PAGE + 7] = 2
            seen = candidate.written(*pages[1])
            others = candidate.written(*pages[0]) or candidate.written(*pages[2])
        finally:
            for page in pages:
                candidate.release(*page)
        return clean and seen and not others
    finally:
        area.close()
