"""The ``ioctl`` calls of kernel write tracking (:mod:`lightning_async_ckpt.core.write_tracker`), and the write
protection of many ranges split between the caller and a helper thread (the kernel walks under a shared lock).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence

__all__ = ["PARALLEL_MIN_BYTES", "UFFDIO_WRITEPROTECT", "WRITEPROTECT_MODE_WP", "ioctl", "load", "write_protect"]

UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
WRITEPROTECT_MODE_WP = 1 << 0
#: Protections of at least this many bytes, in two ranges or more, are split with a helper thread.
PARALLEL_MIN_BYTES = 64 << 20
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

# libc's ioctl called with the GIL held (PyDLL): the calls are short (a page-table walk), and a GIL hand-off back to
# the training thread after each one can cost a scheduler switch interval while background threads run Python.
_with_gil: ctypes.PyDLL | None = None
# The same call without the GIL (CDLL): the caller and the helper of a split protection, so each can run Python
# between its calls while the other is in the kernel.
_without_gil: ctypes.CDLL | None = None


def load() -> None:
    """Bind libc's ``ioctl`` (Linux; called once before the first tracker is made)."""
    global _with_gil, _without_gil
    if _with_gil is not None:
        return
    with_gil, without_gil = ctypes.PyDLL(None, use_errno=True), ctypes.CDLL(None, use_errno=True)
    for lib in (with_gil, without_gil):
        lib.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        lib.ioctl.restype = ctypes.c_int
    _with_gil, _without_gil = with_gil, without_gil


def ioctl(fd: int, request: int, *words: int, hold_gil: bool = True) -> int:
    """``ioctl(fd, request, &words)`` on an array of 64-bit words; the kernel's answer, or ``OSError``."""
    arg = (ctypes.c_uint64 * len(words))(*words)
    lib = _with_gil if hold_gil else _without_gil
    assert lib is not None  # a tracker exists only after load()
    result = lib.ioctl(fd, request, ctypes.addressof(arg))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def write_protect(uffd: int, ranges: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
    """Write-protect the registered ``ranges`` through ``uffd``; returns the ranges that failed.

    At least :data:`PARALLEL_MIN_BYTES` in two or more ranges (and two CPUs) are split in two halves by bytes: a
    helper thread protects one while the caller protects the other, both without the GIL. Otherwise the caller
    protects them in turn with the GIL held.
    """
    if len(ranges) < 2 or sum(e - s for s, e in ranges) < PARALLEL_MIN_BYTES or _CPUS < 2:
        return {r for r in ranges if not _protect(uffd, r, hold_gil=True)}
    mine: list[tuple[int, int]] = []
    theirs: list[tuple[int, int]] = []
    lead = 0  # bytes of mine minus bytes of theirs
    for r in sorted(ranges, key=lambda r: r[1] - r[0], reverse=True):  # largest first, to the lighter side
        side, sign = (mine, 1) if lead <= 0 else (theirs, -1)
        side.append(r)
        lead += sign * (r[1] - r[0])
    half = _Half(uffd, theirs)
    helper = threading.Thread(target=half.run, name="lightning_async_ckpt-protect", daemon=True)
    helper.start()  # a thread per cut (about 0.1 ms): nothing lingers between cuts or across a fork
    try:
        failed = {r for r in mine if not _protect(uffd, r, hold_gil=False)}
    finally:
        helper.join()
    return failed | half.failed


def _protect(uffd: int, span: tuple[int, int], *, hold_gil: bool) -> bool:
    try:
        ioctl(uffd, UFFDIO_WRITEPROTECT, span[0], span[1] - span[0], WRITEPROTECT_MODE_WP, hold_gil=hold_gil)
    except OSError:
        return False
    return True


class _Half:
    """The helper thread's half of a split protection: the ranges of it that failed."""

    def __init__(self, uffd: int, ranges: list[tuple[int, int]]) -> None:
        self.uffd, self.ranges = uffd, ranges
        self.failed: set[tuple[int, int]] = set(ranges)  # until protected

    def run(self) -> None:
        self.failed = {r for r in self.ranges if not _protect(self.uffd, r, hold_gil=False)}
