"""The ``ioctl`` calls of kernel write tracking (:mod:`lightning_async_ckpt.core.write_tracker`), and the write
protection of the ranges a cut tracks.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

__all__ = ["PAGEMAP_SCAN", "PM_SCAN_CHECK_WPASYNC", "PM_SCAN_WP_MATCHING", "ioctl", "load", "write_protect"]

PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
PM_SCAN_WP_MATCHING = 1 << 0
PM_SCAN_CHECK_WPASYNC = 1 << 1

# libc's ioctl called with the GIL held (PyDLL): the calls are short (a page-table walk), and a GIL hand-off back to
# the training thread after each one can cost a scheduler switch interval while background threads run Python.
_libc: ctypes.PyDLL | None = None


def load() -> None:
    """Bind libc's ``ioctl`` (Linux; called once before the first tracker is made)."""
    global _libc
    if _libc is not None:
        return
    lib = ctypes.PyDLL(None, use_errno=True)
    lib.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    lib.ioctl.restype = ctypes.c_int
    _libc = lib


def ioctl(fd: int, request: int, *words: int) -> int:
    """``ioctl(fd, request, &words)`` on an array of 64-bit words; the kernel's answer, or ``OSError``."""
    arg = (ctypes.c_uint64 * len(words))(*words)
    assert _libc is not None  # a tracker exists only after load()
    result = _libc.ioctl(fd, request, ctypes.addressof(arg))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def write_protect(pagemap: int, ranges: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
    """Write-protect the registered ``ranges`` in one ``PAGEMAP_SCAN`` each (through the process's ``pagemap``
    descriptor); returns the ranges that failed.

    The scan's write-protecting walk (``PM_SCAN_WP_MATCHING`` with no output vector: every page of the range,
    unpopulated ones and holes included, since no category is asked) is the kernel's fast path for "protect
    everything": on the 2-core VM a third to a half of ``UFFDIO_WRITEPROTECT``'s time for freshly written 4 KiB
    pages (1 GB: 7.9 ms against 23.1 ms). A walk split between two threads measured slower for both, so the caller
    protects every range in turn, with the GIL held (``benchmarks/bench_guard.py --arming``; docs/benchmarks.md).
    ``PM_SCAN_CHECK_WPASYNC`` refuses a range not registered for asynchronous write protection; a walk the kernel
    ended early counts as failed.
    """
    failed: set[tuple[int, int]] = set()
    for start, end in ranges:
        #   size, flags, start, end, walk_end, vec, vec_len, max_pages, inverted, mask, anyof, return_mask
        words = (96, PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC, start, end, 0, 0, 0, 0, 0, 0, 0, 0)
        arg = (ctypes.c_uint64 * len(words))(*words)
        assert _libc is not None  # a tracker exists only after load()
        if _libc.ioctl(pagemap, PAGEMAP_SCAN, ctypes.addressof(arg)) < 0 or arg[4] != end:
            failed.add((start, end))
    return failed
