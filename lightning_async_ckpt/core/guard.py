"""The runtime guard: did a deferred storage change between the cut and the end of its staging copy?

Two checks, recorded at the cut and checked once the deferred copies landed: version counters (every in-place
operation bumps them), and the bytes, for writes that do not (``GuardMode.FULL``, the default, is exact: kernel
write tracking where available, else CRC-32C per chunk on the host and a position-weighted sum on a device;
``GuardMode.SAMPLE`` compares ``FINGERPRINT_SAMPLES`` random bytes, with :func:`miss_probability`). Counters are
sealed right after a copy landed and before its fence opens. What each mode guarantees is stated in
``docs/concepts.md`` ("The guard").
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_async_ckpt.core.capture import Fence, StorageSlot
from lightning_async_ckpt.core.fingerprint import (
    _CHUNK_WORDS,  # noqa: F401 - re-exported for the checksum's tests
    FINGERPRINT_CHUNK,
    _as_bytes,
    checksum,
    combine_partials,
    device_partials,
    fingerprint,
    fingerprints,
)
from lightning_async_ckpt.core.write_tracker import WriteTracker, page_interior, tracker
from lightning_async_ckpt.errors import ConfigError

__all__ = [
    "FINGERPRINT_CHUNK",
    "FINGERPRINT_SAMPLES",
    "CutGuard",
    "GuardMode",
    "checksum",
    "combine_partials",
    "device_partials",
    "fingerprint",
    "miss_probability",
    "pinned",
    "resolve_guard_mode",
]

FINGERPRINT_SAMPLES = 64
# The exact fingerprint at the cut is spread over threads once the deferred bytes exceed this.
_PARALLEL_BYTES = 32 << 20
# Host storages with at least this many whole pages are write-tracked by the kernel instead of fingerprinted,
# when the cut's trackable bytes reach _TRACK_MIN_TOTAL: below it the per-cut fixed cost (reading /proc/self/maps,
# registering each range) exceeds the fingerprint it replaces (make run's 13 MB state: 12.8 ms against 9.5 ms).
_TRACK_MIN_BYTES = 256 << 10
_TRACK_MIN_TOTAL = 128 << 20


class GuardMode(str, Enum):
    """How the guard checks deferred storages (version counters are checked in every mode but ``OFF``).

    ``FULL`` (the default, also ``True``) is exact: no write between the cut and the staging copy is committed,
    whether or not it bumps a version counter. ``SAMPLE`` is an opt-in that reads 64 bytes per storage at the cut
    and misses a small write with :func:`miss_probability`. ``OFF`` trusts the deferral proof alone.
    """

    OFF = "off"
    SAMPLE = "sample"
    FULL = "full"


def resolve_guard_mode(guard: bool | str | GuardMode) -> GuardMode:
    """``True`` means :attr:`GuardMode.FULL` (exact), ``False`` :attr:`GuardMode.OFF`; strings name a mode."""
    if guard is True:
        return GuardMode.FULL
    if guard is False:
        return GuardMode.OFF
    try:
        return GuardMode(guard)
    except ValueError:
        raise ConfigError(f"guard must be True, False, 'sample', 'full' or 'off', got {guard!r}") from None


def miss_probability(nbytes: int, changed_bytes: int, samples: int = FINGERPRINT_SAMPLES) -> float:
    """Probability that the sampled fingerprint misses a write that changed ``changed_bytes`` of ``nbytes``.

    Positions are drawn uniformly with replacement, so ``P(miss) = (1 - s/n) ** k``; storages of at most
    ``samples`` bytes are compared whole (never missed). The version counter check comes on top of it.
    """
    if nbytes <= samples or changed_bytes >= nbytes:
        return 0.0 if changed_bytes > 0 else 1.0
    return (1.0 - changed_bytes / nbytes) ** samples


def _edge_sums(data: torch.Tensor, head: int, tail: int) -> tuple[int, int]:
    """Fingerprints of ``data[:head]`` and ``data[tail:]``: the partial pages around a write-tracked interior."""
    return fingerprint(data[:head])[0], fingerprint(data[tail:])[0]


def pinned(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` is pinned host memory (asked only once CUDA is initialized: never initializes it)."""
    return torch.cuda.is_initialized() and storage.is_pinned()  # pinned memory exists only once CUDA is initialized


# Ranges the tracker accepted (private anonymous memory), with a weak reference to the storage that held them: while
# that same storage (not freed, its memory not moved) holds them at the next cut, no other mapping can sit there, so
# that cut skips reading /proc/self/maps.
_ACCEPTED: dict[tuple[int, int], StorageWeakRef] = {}
_ACCEPTED_LOCK = threading.Lock()
_ACCEPTED_MAX = 4096


def _still_allocated(ranges: Sequence[tuple[int, int]], storages: Sequence[Any]) -> set[tuple[int, int]]:
    """The ``ranges`` (each where its storage in ``storages`` holds its bytes now) the tracker accepted before for
    that same storage, still alive (forgets the freed ones)."""
    with _ACCEPTED_LOCK:
        if len(_ACCEPTED) > _ACCEPTED_MAX:
            for key in [k for k, ref in _ACCEPTED.items() if ref.expired()]:
                del _ACCEPTED[key]
        cached = [_ACCEPTED.get(r) for r in ranges]
    return {
        r
        for r, ref, storage in zip(ranges, cached, storages, strict=True)
        if ref is not None and not ref.expired() and ref == StorageWeakRef(storage)
    }


def _versions(slot: StorageSlot) -> list[int | None]:
    out: list[int | None] = []
    for t in slot.tensors:
        try:
            out.append(t._version)
        except RuntimeError:  # inference tensors have no version counter
            out.append(None)
    return out


class CutGuard:
    """Records the deferred storages at the cut and tells which of the staged copies may be torn.

    :meth:`record` runs on the training thread at the cut; :meth:`check` runs on the staging thread after every
    deferred copy landed. Not thread-safe beyond that hand-off (the job's thread start orders them).

    Args:
        slots: The deferred storage slots (copy-at-cut ones need no guard).
        mode: What to check besides nothing (``OFF``).
    """

    def __init__(self, slots: Sequence[StorageSlot], mode: GuardMode) -> None:
        self.slots = [s for s in slots if s.fence != Fence.CUT]
        self.mode = mode
        self._versions: dict[int, list[int | None]] = {}
        self._sealed: dict[int, list[int | None]] = {}
        self._samples: dict[int, tuple[Any, Any]] = {}
        # Host slots: the fingerprint; device slots: device_partials, read back only by `check`.
        self._sums: dict[int, tuple[int, ...] | torch.Tensor] = {}
        # Version counters read on the training thread when it reached each slot's fence (see `at_fence`).
        self._at_fence: dict[int, list[int | None]] = {}
        self._fence_lock = threading.Lock()
        # Write-tracked host slots (core/write_tracker.py): index -> (start, end, edge fingerprint at the cut);
        # the pages [start, end) are protected from the cut until their seal, the partial pages fingerprinted.
        self._tracker: WriteTracker | None = None
        self._tracked: dict[int, tuple[int, int, int, int, tuple[int, int]]] = {}
        self._protected: set[int] = set()
        self._written: dict[int, str | None] = {}  # index -> why its pages count as written (None: they were not)
        self._addresses: dict[int, tuple[int, int]] = {}  # index -> (data pointer, bytes) at the cut

    def record(self) -> None:
        """At the cut: version counters, and the sampled bytes or full checksums of every deferred storage."""
        if self.mode == GuardMode.OFF:
            return
        # One draw for every storage, from a private generator: training's RNG streams are untouched. Positions
        # floor(u * n) with u uniform in [0, 1) are uniform over the n bytes (n is far below 2**53).
        rng = np.random.default_rng(secrets.randbits(63))
        sizes = np.array([slot.nbytes for slot in self.slots], dtype=np.float64)
        positions = (rng.random((len(self.slots), FINGERPRINT_SAMPLES)) * sizes[:, None]).astype(np.int64)
        on_device: dict[torch.device, list[tuple[StorageSlot, np.ndarray]]] = {}
        if self.mode == GuardMode.FULL:
            self._record_full()
            return
        for row, slot in enumerate(self.slots):
            self._versions[slot.index] = _versions(slot)
            data = _as_bytes(slot.storage)
            idx = np.arange(slot.nbytes) if slot.nbytes <= FINGERPRINT_SAMPLES else positions[row]
            if slot.device.type == "cpu":
                self._samples[slot.index] = (idx, data.numpy()[idx])  # fancy indexing copies
            else:
                on_device.setdefault(slot.device, []).append((slot, idx))
        for device, rows in on_device.items():
            # One asynchronous upload of every position per device (from pinned memory), then one gather kernel per
            # storage on the compute stream, ordered at the cut: no host synchronization. The samples are read
            # back by `check`, on the staging thread.
            flat = torch.from_numpy(np.concatenate([idx for _, idx in rows])).pin_memory()
            flat = flat.to(device, non_blocking=True)
            start = 0
            for slot, idx in rows:
                positions_dev = flat[start : start + len(idx)]
                start += len(idx)
                self._samples[slot.index] = (idx, _as_bytes(slot.storage)[positions_dev])

    def _record_full(self) -> None:
        # Every deferred byte is accounted for on the training thread at the cut. Large host storages: their whole
        # pages are write-protected by the kernel (a page-table walk, no read; see core/write_tracker.py) and only
        # their partial first and last pages are fingerprinted. Other host storages are cut into chunks hashed on a
        # few short-lived threads (CRC-32C releases the GIL); device storages reduce on the device, asynchronously
        # (ordered on the compute stream before the cut's event; read back by `check`).
        host = []
        for slot in self.slots:
            self._versions[slot.index] = _versions(slot)
            if slot.device.type != "cpu":
                self._sums[slot.index] = device_partials(_as_bytes(slot.storage))
            else:
                host.append(slot)
        host = self._track(host)
        workers = min(4, os.cpu_count() or 1)
        if sum(slot.nbytes for slot in host) < _PARALLEL_BYTES or workers < 2:
            for slot in host:
                self._sums[slot.index] = fingerprint(_as_bytes(slot.storage))
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="lightning_async_ckpt-fingerprint") as pool:
            sums = fingerprints([_as_bytes(slot.storage) for slot in host], pool)
        self._sums.update((slot.index, value) for slot, value in zip(host, sums, strict=True))

    def _track(self, host: list[StorageSlot]) -> list[StorageSlot]:
        """Write-protect the whole pages of the large host slots (their partial pages fingerprinted here); returns
        the slots to fingerprint whole."""
        # Shared memory has writers in other processes; pinned memory may be written by DMA.
        candidates = [s for s in host if s.nbytes >= _TRACK_MIN_BYTES and not s.storage.is_shared()]
        candidates = [s for s in candidates if not pinned(s.storage)]
        if sum(s.nbytes for s in candidates) < _TRACK_MIN_TOTAL or (
            self._tracker is None and (tracker_ := tracker()) is None
        ):
            return host
        self._tracker = self._tracker or tracker_
        spans = {s.index: (s.storage.data_ptr(), *page_interior(s.storage.data_ptr(), s.nbytes)) for s in candidates}
        candidates = [s for s in candidates if spans[s.index][2] - spans[s.index][1] >= _TRACK_MIN_BYTES]
        ranges = [spans[s.index][1:] for s in candidates]
        armed = self._tracker.protect_all(ranges, _still_allocated(ranges, [s.storage for s in candidates]))
        for slot, ok in zip(candidates, armed, strict=True):
            if ok:
                with _ACCEPTED_LOCK:
                    _ACCEPTED[spans[slot.index][1:]] = StorageWeakRef(slot.storage)
                address, start, end = spans[slot.index]
                head, tail = start - address, end - address
                self._protected.add(slot.index)
                self._tracked[slot.index] = (start, end, head, tail, _edge_sums(_as_bytes(slot.storage), head, tail))
                self._addresses[slot.index] = (address, slot.nbytes)
        return [s for s in host if s.index not in self._tracked]

    def seal(self, slots: Sequence[StorageSlot]) -> None:
        """Right after ``slots`` were copied and before their fence opens: read their version counters again, and
        ask the kernel whether a write-tracked slot's pages were written since the cut (then lift the protection,
        so the optimizer's own writes after the fence take no fault)."""
        if self.mode != GuardMode.OFF:
            for slot in slots:
                self._sealed[slot.index] = _versions(slot)
                if slot.index in self._protected and self._tracker is not None:
                    start, end = self._tracked[slot.index][:2]
                    try:
                        self._written[slot.index] = "page written" if self._tracker.written(start, end) else None
                    except OSError as exc:  # cannot prove it unwritten: refused
                        self._written[slot.index] = f"write tracking failed: {exc}"
                    if (slot.storage.data_ptr(), slot.storage.nbytes()) != self._addresses[slot.index]:
                        self._written[slot.index] = "storage moved (resized) since the cut"
                    self._protected.discard(slot.index)
                    self._tracker.release(start, end)

    def release(self) -> None:
        """Lift the protection of every slot still write-tracked (a staging that failed or was abandoned)."""
        for index in list(self._protected):
            self._protected.discard(index)
            if self._tracker is not None:
                start, end = self._tracked[index][:2]
                self._tracker.release(start, end)

    def __del__(self) -> None:
        try:  # a job dropped before its staging ran (its owner failed at the cut): never leave pages armed
            self.release()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the process's protection ends with it
            pass

    @property
    def tracked_bytes(self) -> int:
        """Deferred bytes the kernel tracked for writes at this cut (the rest was fingerprinted)."""
        return sum(t[1] - t[0] for t in self._tracked.values())

    def at_fence(self, slots: Sequence[StorageSlot]) -> None:
        """On the training thread, the first time it reaches these slots' fence: read their version counters.

        Every tensor operation the training thread ran before the fence has returned, its counter bump included,
        so this closes the seal's one blind spot: a write still running when the copy landed (its bump comes
        after the seal), which the sampled fingerprint may miss.
        """
        if self.mode == GuardMode.OFF:
            return
        with self._fence_lock:
            for slot in slots:
                if slot.index in self._versions and slot.index not in self._at_fence:
                    self._at_fence[slot.index] = _versions(slot)

    def confirm(self) -> list[tuple[StorageSlot, str]]:
        """Right before the commit: the slots whose version counter moved between the cut and their fence.

        A slot whose fence was not reached yet is read now: nothing may legitimately write it before its fence,
        so any movement is a write the proof did not foresee (refused conservatively). The lock orders this
        read with :meth:`at_fence`, so a legitimate write after the fence is never mistaken for one before it.
        """
        if self.mode == GuardMode.OFF:
            return []
        found = []
        with self._fence_lock:
            for slot in self.slots:
                cut = self._versions.get(slot.index)
                seen = self._at_fence.get(slot.index)
                if seen is None:
                    seen = _versions(slot)
                if cut is not None and seen != cut:
                    found.append((slot, "version counter before its fence"))
        return found

    def check(
        self, buffers: Sequence[torch.Tensor], staged: dict[int, tuple[int, ...]] | None = None
    ) -> list[tuple[StorageSlot, str]]:
        """After the copies: the slots whose staged copy may differ from the cut, each with the check that saw it.

        ``staged``: the exact fingerprint of staged host buffers already computed while they were copied (by slot
        index; CRC-32C per :data:`FINGERPRINT_CHUNK`); the others are read here.
        """
        staged_sums = staged or {}
        if self.mode == GuardMode.OFF:
            return []
        torn: dict[int, tuple[StorageSlot, str]] = {}
        for slot in self.slots:
            buf = buffers[slot.index]
            if self.mode == GuardMode.FULL and slot.index in self._tracked:
                _, _, head, tail, edges = self._tracked[slot.index]
                why = self._written.get(slot.index, "not sealed before its fence")
                if why is None and _edge_sums(buf, head, tail) != edges:
                    why = "checksum of a partial page"
                if why is not None:
                    torn[slot.index] = (slot, why)
            elif self.mode == GuardMode.FULL:
                # The staged copy is on the host; a device storage's fingerprint is the device-side checksum.
                expected = self._sums[slot.index]
                if isinstance(expected, torch.Tensor):
                    expected = (combine_partials(expected.tolist()),)
                if slot.device.type != "cpu":
                    copy: tuple[int, ...] = (checksum(buf),)
                else:
                    copy = staged_sums.get(slot.index) or fingerprint(buf)
                if copy != expected:
                    torn[slot.index] = (slot, "checksum")
            else:
                idx, expected = self._samples[slot.index]
                if isinstance(expected, torch.Tensor):
                    expected = expected.cpu().numpy()
                if not np.array_equal(buf.numpy()[idx], expected):
                    torn[slot.index] = (slot, "fingerprint")
        for slot in self.slots:
            sealed = self._sealed.get(slot.index) or _versions(slot)
            if slot.index not in torn and sealed != self._versions[slot.index]:
                torn[slot.index] = (slot, "version counter")
        return list(torn.values())
