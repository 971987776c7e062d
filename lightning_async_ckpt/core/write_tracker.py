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

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import struct
import sys
import threading

__all__ = ["PAGE", "WriteTracker", "page_interior", "tracker"]

_log = logging.getLogger("lightning_async_ckpt")

PAGE = mmap.PAGESIZE
_SYSCALL = {"x86_64": 323, "aarch64": 282}  # userfaultfd(2)
_UFFD_USER_MODE_ONLY = 1
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1


# libc's ioctl called with the GIL held (PyDLL): the calls are short (a page-table walk), and a GIL hand-off back to
# the training thread after each one can cost a scheduler switch interval while background threads run Python.
_libc: ctypes.PyDLL | None = None  # set by _open (Linux only)


def _ioctl(fd: int, request: int, *words: int) -> int:
    """``ioctl(fd, request, &words)`` on an array of 64-bit words; the kernel's answer, or ``OSError``."""
    arg = (ctypes.c_uint64 * len(words))(*words)
    assert _libc is not None  # a tracker exists only after _open set it
    result = _libc.ioctl(fd, request, ctypes.addressof(arg))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


def page_interior(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: ``(start, end)``, empty when ``start >= end``."""
    start = -(-address // PAGE) * PAGE
    return start, (address + nbytes) // PAGE * PAGE


class WriteTracker:
    """Write-protects page ranges and reports whether they were written since (one per process).

    Thread-safety: every method takes the tracker's lock; a range is tracked by one session at a time.

    Args:
        uffd: A ``userfaultfd`` descriptor after its ``UFFDIO_API`` handshake with asynchronous write protection.
        pagemap: A descriptor of ``/proc/self/pagemap`` opened by this process.
    """

    def __init__(self, uffd: int, pagemap: int) -> None:
        self.pid = os.getpid()
        self._uffd = uffd
        self._pagemap = pagemap
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}  # start -> end of every protected range
        self._region = (_Region * 1)()

    def protect(self, start: int, end: int) -> bool:
        """Write-protect the page-aligned ``[start, end)``; ``False`` when it cannot be tracked (fingerprint it).

        Refused: a range overlapping one tracked now (its session's scan would be reset), memory that is not private
        and anonymous (a shared or file mapping changes without a write through this process's page tables: another
        process, ``write`` to the file, another mapping of the same pages), or any error. Only a range this
        tracker registered is ever protected, and it registers a range only after checking its mappings, so memory
        mapped anew at a registered address is checked again.
        """
        if start >= end or start % PAGE or end % PAGE:
            return False
        with self._lock:
            if any(s < end and start < e for s, e in self._active.items()):
                return False
            try:
                self._write_protect(start, end, on=True)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.EINVAL):
                    return False
                if not _private_anonymous(start, end):
                    return False  # shared or file memory changes without a write through these page tables
                try:  # not registered yet (or remapped since): register, then protect
                    _ioctl(self._uffd, _UFFDIO_REGISTER, start, end - start, _REGISTER_MODE_WP, 0)
                    self._write_protect(start, end, on=True)
                except OSError:
                    try:  # a part may have been protected before the error: lift it (nobody would scan it)
                        self._write_protect(start, end, on=False)
                    except OSError:
                        pass
                    return False
            self._active[start] = end
            return True

    def written(self, start: int, end: int) -> bool:
        """Whether any page of the tracked ``[start, end)`` was written since :meth:`protect`.

        Raises:
            OSError: The kernel could not scan the range (the caller refuses the snapshot: it cannot prove it).
        """
        with self._lock:
            region = ctypes.addressof(self._region)
            args = (96, _PM_SCAN_CHECK_WPASYNC, start, end, 0, region, 1, 0, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN)
            return _ioctl(self._pagemap, _PAGEMAP_SCAN, *args) > 0

    def release(self, start: int, end: int) -> None:
        """Stop tracking ``[start, end)``: lift the protection so later writes (the optimizer's) take no fault."""
        with self._lock:
            if self._active.pop(start, None) is None:
                return
            try:
                self._write_protect(start, end, on=False)
            except OSError:  # unmapped since (the storage was freed): nothing left to unprotect
                pass

    @property
    def active(self) -> int:
        """How many ranges are tracked now."""
        with self._lock:
            return len(self._active)

    def _write_protect(self, start: int, end: int, *, on: bool) -> None:
        mode = _WRITEPROTECT_MODE_WP if on else 0
        _ioctl(self._uffd, _UFFDIO_WRITEPROTECT, start, end - start, mode)


_ANONYMOUS_NAMES = ("", "[heap]", "[stack]")


def _private_anonymous(start: int, end: int) -> bool:
    """Whether ``/proc/self/maps`` shows ``[start, end)`` covered by private anonymous mappings only."""
    covered = start
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if high <= covered or low >= end:
                    continue
                name = fields[5].strip() if len(fields) > 5 else ""
                anonymous = name in _ANONYMOUS_NAMES or name.startswith("[anon:")
                if low > covered or fields[1][3] != "p" or not anonymous:
                    return False
                covered = high
                if covered >= end:
                    return True
    except (OSError, ValueError, IndexError):
        return False
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
    global _libc
    _libc = ctypes.PyDLL(None, use_errno=True)
    _libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    _libc.ioctl.restype = ctypes.c_int
    uffd = _libc.syscall(number, os.O_CLOEXEC | _UFFD_USER_MODE_ONLY)
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
        if not candidate.protect(base, base + 3 * PAGE):
            return False
        try:
            clean = not candidate.written(base, base + 3 * PAGE)
            area[PAGE + 7] = 2
            seen = candidate.written(base + PAGE, base + 2 * PAGE)
            others = candidate.written(base, base + PAGE) or candidate.written(base + 2 * PAGE, base + 3 * PAGE)
        finally:
            candidate.release(base, base + 3 * PAGE)
        return clean and seen and not others
    finally:
        area.close()
