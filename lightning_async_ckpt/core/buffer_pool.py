"""The staging pool: host buffers reused across checkpoints within a host-memory budget.

Pinned buffers for CUDA storages; pageable ones of at least 1 MiB are page-aligned private mappings, so a
direct-I/O file writes the staged bytes from them without a copy (:mod:`lightning_async_ckpt.storage.direct`).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import Counter
from collections.abc import Sequence

import psutil
import torch

from lightning_async_ckpt.core.capture import StorageSlot
from lightning_async_ckpt.core.units import parse_size
from lightning_async_ckpt.errors import ConfigError, HostMemoryBudgetError

__all__ = ["AUTO_BUDGET_FRACTION", "BufferPool", "resolve_budget"]

AUTO_BUDGET_FRACTION = 0.5
# Pageable staging buffers at least this large are page-aligned anonymous mappings (private: never shared with a
# forked child); smaller ones come from torch's allocator.
_ALIGNED_MIN = 1 << 20
_PRIVATE = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def resolve_budget(budget: int | str | None, reserved_bytes: int = 0) -> int | None:
    """Turn a budget setting into bytes.

    Args:
        budget: Bytes (an int, or a size such as ``"4GiB"``); ``"auto"`` for ``AUTO_BUDGET_FRACTION`` (half) of the host memory available now, minus
            ``reserved_bytes``; ``None`` for no limit.
        reserved_bytes: Host memory other consumers need (input prefetch, optimizer offload, other processes).
    """
    if budget is None:
        return None
    if budget == "auto":
        return max(0, int(psutil.virtual_memory().available * AUTO_BUDGET_FRACTION) - reserved_bytes)
    if isinstance(budget, str):
        with contextlib.suppress(ValueError):  # refused below, with the accepted forms
            budget = int(parse_size(budget))
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ConfigError(
            f"host_memory_budget must be a positive number of bytes (an int, or a size such as '4GiB' or '500MB'), "
            f"'auto' or None, got {budget!r}"
        )
    if reserved_bytes >= budget:
        raise ConfigError(
            f"reserved_host_bytes ({reserved_bytes:,}) leaves nothing of host_memory_budget ({budget:,}) for staging; "
            "raise host_memory_budget or lower reserved_host_bytes"
        )
    return budget - reserved_bytes


class BufferPool:
    """Host buffers reused across checkpoints, bounded by a budget.

    Buffers are ``uint8`` tensors of one storage's size, pinned when staging from CUDA. A buffer handed out by
    :meth:`acquire` is not handed out again until :meth:`release` (called once the upload stopped reading it).
    Thread-safe.

    Args:
        budget_bytes: Most bytes the pool may retain; ``None`` for no limit.
    """

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.retained_bytes = 0
        self.peak_bytes = 0
        self.in_use_bytes = 0
        #: Buffers allocated so far (by :meth:`acquire` at a cut, or :meth:`reserve` ahead of it).
        self.allocations = 0
        #: Of those, allocated by :meth:`acquire`, i.e. at a cut, on the training thread.
        self.allocations_at_cut = 0
        self.bytes_allocated_at_cut = 0
        self._reserving: list[threading.Event] = []
        #: Reservations begun so far (a step clock tells the periods in which one ran).
        self.reservations = 0

    def check(self, needed_bytes: int) -> None:
        """Raise before training if one snapshot of ``needed_bytes`` cannot fit the budget."""
        if self.budget_bytes is not None and needed_bytes > self.budget_bytes:
            raise HostMemoryBudgetError(
                f"staging needs {needed_bytes:,} bytes of host memory but host_memory_budget allows "
                f"{self.budget_bytes:,} (available now: {psutil.virtual_memory().available:,}); raise "
                "host_memory_budget, lower reserved host bytes, or save less state"
            )

    def acquire(self, slots: Sequence[StorageSlot]) -> list[torch.Tensor]:
        """Hand out one buffer per slot, reusing free ones of the same size (after a pending :meth:`reserve`)."""
        for reserving in list(self._reserving):
            reserving.wait()
        out: list[torch.Tensor] = []
        with self._lock:
            needed = sum(s.nbytes for s in slots)
            wanted = Counter((s.nbytes, _pin(s)) for s in slots)
            # Only as many free buffers of a size as the plan needs count as reusable.
            reusable = sum(min(len(self._free.get(key, ())), count) * key[0] for key, count in wanted.items())
            grow = needed - reusable
            if self.budget_bytes is not None and self.retained_bytes + grow > self.budget_bytes:
                # Drop free buffers this plan will not reuse, then check again.
                self._trim(self.retained_bytes + grow - self.budget_bytes, keep=wanted)
            if self.budget_bytes is not None and self.retained_bytes + grow > self.budget_bytes:
                raise HostMemoryBudgetError(
                    f"staging needs {grow:,} more bytes but {self.retained_bytes:,} are retained of a "
                    f"host_memory_budget of {self.budget_bytes:,}; raise host_memory_budget or lower max_outstanding"
                )
            for s in slots:
                free = self._free.get((s.nbytes, _pin(s)))
                if free:
                    out.append(free.pop())
                else:
                    out.append(_new_buffer(s.nbytes, _pin(s), touch=False))  # faulted in by the staging copy
                    self.retained_bytes += s.nbytes
                    self.allocations += 1
                    self.allocations_at_cut += 1
                    self.bytes_allocated_at_cut += s.nbytes
            self.in_use_bytes += needed
            self.peak_bytes = max(self.peak_bytes, self.retained_bytes)
        return out

    def release(self, buffers: Sequence[torch.Tensor]) -> None:
        """Return buffers once nothing reads them any more."""
        with self._lock:
            for buf in buffers:
                self._free.setdefault((buf.numel(), buf.is_pinned()), []).append(buf)
                self.in_use_bytes -= buf.numel()

    def begin_reserve(self) -> threading.Event:
        """Announce a :meth:`reserve` (returns its ticket): :meth:`acquire` waits for it instead of allocating."""
        ticket = threading.Event()
        with self._lock:
            self._reserving.append(ticket)
            self.reservations += 1
        return ticket

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Wait until every :meth:`reserve` announced so far ended; ``False`` on timeout."""
        with self._lock:
            tickets = list(self._reserving)
        return all(ticket.wait(timeout) for ticket in tickets)

    @property
    def reserving(self) -> bool:
        """Whether a :meth:`reserve` announced by :meth:`begin_reserve` is still running."""
        return bool(self._reserving)

    def reserve(self, slots: Sequence[StorageSlot], *, ticket: threading.Event | None = None) -> int:
        """Allocate free buffers for ``slots`` ahead of the cut (pinned for CUDA storages), within the budget.

        Buffers already free count; the rest are allocated outside the lock (pinned allocation is slow).

        Returns:
            Bytes newly allocated.
        """
        try:
            with self._lock:
                wanted = Counter((s.nbytes, _pin(s)) for s in slots)
                have = {k: len(self._free.get(k, ())) for k in wanted}
                missing = {k: n - have[k] for k, n in wanted.items() if n > have[k]}
                grow = sum(k[0] * n for k, n in missing.items())
                if self.budget_bytes is not None and self.retained_bytes + grow > self.budget_bytes:
                    raise HostMemoryBudgetError(
                        f"reserving {grow:,} bytes of staging buffers would exceed host_memory_budget "
                        f"({self.budget_bytes:,}; {self.retained_bytes:,} retained); raise host_memory_budget"
                    )
                self.retained_bytes += grow  # counted now: a concurrent acquire sees the budget as taken
            made = [
                (key, _new_buffer(key[0], key[1], touch=True)) for key, count in missing.items() for _ in range(count)
            ]
            with self._lock:
                for key, buf in made:
                    self._free.setdefault(key, []).append(buf)
                self.allocations += len(made)
                self.peak_bytes = max(self.peak_bytes, self.retained_bytes)
            return grow
        finally:
            if ticket is not None:
                with self._lock:
                    if ticket in self._reserving:
                        self._reserving.remove(ticket)
                ticket.set()

    def _trim(self, excess: int, keep: Counter | None = None) -> None:
        for key in list(self._free):
            spare = len(self._free[key]) - (keep or Counter())[key]
            while spare > 0 and excess > 0:
                buf = self._free[key].pop()
                self.retained_bytes -= buf.numel()
                excess -= buf.numel()
                spare -= 1

    def clear(self) -> None:
        """Drop the free buffers."""
        with self._lock:
            self._trim(self.retained_bytes)


def _new_buffer(nbytes: int, pin: bool, *, touch: bool) -> torch.Tensor:
    """A staging buffer of ``nbytes``: pinned for CUDA storages; pageable ones of at least :data:`_ALIGNED_MIN` are
    page-aligned (torch's allocator aligns to 64 bytes), so a direct-I/O file writes them without a copy.

    ``touch`` (a buffer reserved ahead of the cut): its pages are made resident now (populated by the kernel for a
    mapping, else one single-threaded memset: no OpenMP team beside training's); untouched, they would fault on the first staging copy while training runs (0.8 s
    per 800 MB on the 2-core VM, most of it waited for at the first cut's fence). Pinned memory is resident already.
    """
    if pin or nbytes < _ALIGNED_MIN:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        if touch and not pin and nbytes:
            buf.numpy().fill(0)
        return buf
    # MAP_POPULATE: the kernel populates the mapping inside mmap(), without a page fault per page (0.40-0.49 s per
    # 800 MB on the 2-core VM against 0.66-0.75 s for faulting it in by a memset).
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=_PRIVATE | (_POPULATE if touch else 0)), dtype=torch.uint8)


def _pin(slot: StorageSlot) -> bool:
    return slot.device.type == "cuda"
