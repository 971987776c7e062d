"""Transparent huge pages under the memory a save write-protects (opt-in: ``CheckpointOptions.huge_pages``).

The exact guard write-protects every deferred host storage at each cut and lifts the protection once it is copied:
two page-table walks over every 4 KiB page (about 10 ms per 800 MB at the cut on the 2-core VM, the largest part of a
deferred cut). Over 2 MiB pages the walks are 512 times shorter. With ``huge_pages=True``, after a save's copies
landed (its protection lifted), a short-lived thread asks the kernel once per storage to back it with huge pages:
``madvise(MADV_HUGEPAGE)`` then ``MADV_COLLAPSE`` (Linux 6.1+; about 2 s of CPU per GB, once), while the staging
thread goes on with the next save. The kernel never collapses pages a write protection is armed on (a later cut's:
that span is tried again after a later save), and a collapse keeps the bytes, so the training loop may run and write
meanwhile. Where the kernel lacks either call, the pages stay as they are (nothing is refused or lost).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Iterable

__all__ = ["HUGE_PAGE", "advise_huge_pages", "advise_in_background"]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_log = logging.getLogger("lightning_async_ckpt")
_lock = threading.Lock()
_advised: set[tuple[int, int]] = set()  # collapsed, or being collapsed now
_pid = os.getpid()
_madvise: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]


def _bind() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _madvise
    if _madvise is None and sys.platform.startswith("linux"):
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # without the GIL: a collapse takes milliseconds
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        _madvise = madvise
    return _madvise


def advise_huge_pages(spans: Iterable[tuple[int, int]]) -> int:
    """Back the whole 2 MiB pages inside each ``(address, nbytes)`` with huge pages, once per span and process.

    Returns:
        The bytes the kernel collapsed into huge pages in this call (0 where it cannot, or where done before).
    """
    global _pid
    madvise = _bind()
    if madvise is None:
        return 0
    collapsed = 0
    for address, nbytes in spans:
        start = -(-address // HUGE_PAGE) * HUGE_PAGE
        end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        with _lock:
            if os.getpid() != _pid:  # a forked child: its memory is its own
                _advised.clear()
                _pid = os.getpid()
            if (start, end) in _advised:
                continue
            _advised.add((start, end))
        if madvise(start, end - start, _MADV_HUGEPAGE) == 0 and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed += end - start
        else:  # e.g. a later cut armed it meanwhile (EINVAL), or no huge page was free (EAGAIN): tried again later
            with _lock:
                _advised.discard((start, end))
    return collapsed


class _Collapse(threading.Thread):
    def __init__(self, spans: list[tuple[int, int]], keep_alive: list[object]) -> None:
        super().__init__(name="lightning_async_ckpt-hugepages", daemon=True)
        self.spans, self.keep_alive, self.collapsed = spans, keep_alive, 0

    def run(self) -> None:
        try:
            self.collapsed = advise_huge_pages(self.spans)
        except Exception as exc:  # noqa: BLE001 - an optimization: the pages stay as they are
            _log.warning("huge_pages: could not collapse the deferred storages (%s: %s)", type(exc).__name__, exc)
        finally:
            self.keep_alive = []


def advise_in_background(spans: list[tuple[int, int]], keep_alive: list[object]) -> threading.Thread:
    """:func:`advise_huge_pages` of ``spans`` on a new daemon thread (started; its ``collapsed`` is the result once
    joined), holding ``keep_alive`` (the storages) until it ends."""
    thread = _Collapse(spans, keep_alive)
    thread.start()
    return thread
