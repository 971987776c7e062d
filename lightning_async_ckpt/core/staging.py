"""Staging: make a snapshot independent of application memory, into reusable host buffers.

CPU tensors are copied by a named background thread. CUDA tensors are copied into pinned buffers on a side
stream that first waits on an event recorded on the compute stream at the cut; a fence on CUDA makes the compute
stream wait on the copy's completion event, so the host does not block at all.

The runtime guard (:mod:`lightning_async_ckpt.core.guard`) records the version counters and a fingerprint of every
deferred storage at the cut and checks them once the copies landed. A change means the deferral's proof was wrong:
the job fails with :class:`~lightning_async_ckpt.errors.TornSnapshotError`.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_async_ckpt.core.buffer_pool import AUTO_BUDGET_FRACTION, BufferPool, resolve_budget
from lightning_async_ckpt.core.capture import Category, Fence, StorageSlot
from lightning_async_ckpt.core.cuda_copy import CudaCopies, as_bytes
from lightning_async_ckpt.core.guard import FINGERPRINT_CHUNK, CutGuard, GuardMode, pinned, resolve_guard_mode
from lightning_async_ckpt.core.huge_pages import advise_in_background
from lightning_async_ckpt.errors import CheckpointError, TornSnapshotError
from lightning_async_ckpt.storage.io import crc32c_combine, crc32c_in_place

__all__ = ["AUTO_BUDGET_FRACTION", "BufferPool", "StagingJob", "resolve_budget"]

# Background host copies run in chunks of this many bytes, so an abandoned save stops within one chunk.
_COPY_CHUNK = 64 << 20
# Copy-at-cut host storages up to this size are copied with the GIL held: torch's copy_ releases it, and getting it
# back costs up to a switch interval (5 ms) whenever a background thread runs Python, once per small tensor.
_SMALL_COPY = 64 << 10
# Background copies are checksummed in blocks of this size, each right after it was copied (still in the cache): on
# the 2-core VM 0.12 CPU s per GB for both alone, against 0.18 for a copy and a later CRC-32C pass; 1 MiB measured
# better than 256 KiB and 4 MiB beside a busy training thread.
_CRC_BLOCK = 1 << 20
assert _COPY_CHUNK % FINGERPRINT_CHUNK == 0  # chunks of the fingerprint never straddle two copy chunks
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # noqa: SLF001 - ctypes' own memmove, called through a GIL-holding prototype
)


def _copy_in_chunks(
    dst: np.ndarray, src: np.ndarray, abandon: threading.Event | None, crc: Any = None
) -> tuple[int, ...] | None:
    """``np.copyto`` in chunks, stopping between them once ``abandon`` is set (never touching memory after it).

    With ``crc`` (the ``crc32c`` package), each block is checksummed right after it was copied, while it is still in
    the cache: returns the CRC-32C of every :data:`FINGERPRINT_CHUNK` of ``dst`` (the exact guard's fingerprint of the
    staged copy, and the upload's checksum, without another pass over memory).
    """
    n = len(src)
    sums: list[int] = []
    for start in range(0, max(n, 1), _COPY_CHUNK):
        if abandon is not None and abandon.is_set():
            raise CheckpointError("staging abandoned: the save was abandoned at close")
        if crc is None:
            np.copyto(dst[start : start + _COPY_CHUNK], src[start : start + _COPY_CHUNK])
            continue
        for chunk in range(start, min(start + _COPY_CHUNK, n), FINGERPRINT_CHUNK):
            value, chunk_end = 0, min(chunk + FINGERPRINT_CHUNK, n)
            for block in range(chunk, chunk_end, _CRC_BLOCK):
                end = min(block + _CRC_BLOCK, chunk_end)
                np.copyto(dst[block:end], src[block:end])
                value = crc.crc32c(dst[block:end], value)
            sums.append(value)
    return tuple(sums) if crc is not None and n else None


def _copy_wide(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` of two flat byte tensors, through 8-byte words where both are aligned: torch copies
    ``int64`` elements faster than bytes (806 MB on the 2-core VM, median of 8: 50.4 ms against 53.5 ms)."""
    if src.numel() % 8 == 0 and src.data_ptr() % 8 == 0 and dst.data_ptr() % 8 == 0 and dst.numel() == src.numel():
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)


@dataclass
class _FenceState:
    event: threading.Event = field(default_factory=threading.Event)
    cuda_events: dict = field(default_factory=dict)  # device -> event recorded after that device's copies
    waited_s: float = 0.0
    guard_read: bool = False  # the training thread read this fence's version counters (CutGuard.at_fence)


class StagingJob:
    """Copies one checkpoint's deferred storages into host buffers and tracks their fences.

    Created on the caller thread at the cut (copy-at-cut storages are copied there and then); :meth:`run` copies
    the rest on the staging thread; :meth:`wait` is called on the training thread at each fence.

    Args:
        slots: The plan's storage slots.
        buffers: One host buffer per slot.
        guard: ``True``/``"full"`` (exact): version counters plus a fingerprint of every byte; ``"sample"``: version
            counters plus a sampled fingerprint; ``False``/``"off"``: no check (see :mod:`lightning_async_ckpt.core.guard`).
    """

    def __init__(
        self, slots: Sequence[StorageSlot], buffers: Sequence[torch.Tensor], *, guard: bool | str = True
    ) -> None:
        self.slots = list(slots)
        self.buffers = list(buffers)
        self.guard = resolve_guard_mode(guard)
        self.fences = {f: _FenceState() for f in (Fence.BATCH_START, Fence.OPTIMIZER_STEP)}
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.torn_categories: set[Category] = set()
        self.staging_s = 0.0
        self.stage_started = 0.0
        self.stage_started_wall = 0.0
        self.stage_ended = 0.0
        #: Set by the owner when the save is abandoned: the copy stops at the next chunk.
        self.abandon: threading.Event | None = None
        #: Called on the staging thread right after a fence was released (observability and tests).
        self.on_release: Callable[[Fence], None] | None = None
        #: CRC-32C of every FINGERPRINT_CHUNK of each staged host buffer, by slot index, computed during its copy.
        self.staged_sums: dict[int, tuple[int, ...]] = {}
        #: Set by the owner (``CheckpointOptions.huge_pages``): once copied, the deferred host storages are backed
        #: with huge pages (:mod:`~lightning_async_ckpt.core.huge_pages`), so the next cuts protect them faster.
        self.huge_pages = False
        self.huge_page_thread: threading.Thread | None = None  # the collapse after this job (huge_pages)
        self._deferred = [s for s in self.slots if s.fence != Fence.CUT]
        self._guard = CutGuard(self._deferred, self.guard)
        # Earlier fences first, so the first wait is released as soon as possible.
        self._deferred.sort(key=lambda s: 0 if s.fence == Fence.BATCH_START else 1)
        self._cuda = CudaCopies()

    # -- at the cut, on the caller thread ----------------------------------------------------------------
    def copy_at_cut(self, side_streams: dict[torch.device, torch.cuda.Stream] | None = None) -> None:
        """Copy the copy-at-cut storages, fingerprint the deferred ones, and enqueue every CUDA copy.

        CUDA copies never block the host here: copy-at-cut ones are ordered on the compute stream before any later
        write, deferred ones on a side stream after the cut's event (see :mod:`~lightning_async_ckpt.core.cuda_copy`).
        """
        cut_devices: set[torch.device] = set()
        for slot, buf in zip(self.slots, self.buffers, strict=True):
            if slot.fence != Fence.CUT:
                continue
            if slot.device.type == "cuda" and self._cuda.copy_at_cut(slot, buf):
                cut_devices.add(slot.device)
            elif slot.device.type == "cpu" and slot.nbytes <= _SMALL_COPY:
                _memmove_holding_gil(buf.data_ptr(), slot.storage.data_ptr(), slot.nbytes)
            else:
                _copy_wide(buf, as_bytes(slot.storage))
        self._guard.record()
        cuda = [s for s in self._deferred if s.device.type == "cuda"]
        self._cuda.mark_cut(cut_devices | {s.device for s in cuda})
        if cuda:
            self._cuda.issue_deferred(cuda, self.buffers, side_streams)
            for fence, events in self._cuda.fence_events.items():
                # Issued (not landed) is what the seal has always meant on CUDA: a write issued before the fence is
                # ordered before the copy on no stream, so the version counters read at the fence catch it.
                self._guard.seal([s for s in cuda if s.fence == fence])
                self.fences[fence].cuda_events = dict(events)
        for fence, state in self.fences.items():
            if not any(s.fence == fence and s.device.type != "cuda" for s in self._deferred):
                state.event.set()  # nothing left for the staging thread at this fence: CUDA waits on its events

    # -- on the staging thread ---------------------------------------------------------------------------
    def run(self) -> None:
        """Copy the deferred storages, release fences as their storages land, then check the guard."""
        self.stage_started = time.perf_counter()
        self.stage_started_wall = time.time()
        try:
            host = [s for s in self._deferred if s.device.type != "cuda"]
            pending = {f: sum(1 for s in host if s.fence == f) for f in self.fences}
            crc = crc32c_in_place()
            for slot in host:
                # A single-threaded memcpy that releases the GIL: torch's copy_ would start a second OpenMP team
                # on this thread, whose spinning workers compete with the training thread's team.
                sums = _copy_in_chunks(
                    self.buffers[slot.index].numpy(), as_bytes(slot.storage).numpy(), self.abandon, crc
                )
                if sums is not None:
                    self.staged_sums[slot.index] = sums
                pending[slot.fence] -= 1
                if pending[slot.fence] == 0:
                    # Version counters are read before the fence opens: the optimizer's own step comes after it.
                    self._guard.seal([s for s in host if s.fence == slot.fence])
                    self._release(slot.fence)
            self._cuda.synchronize()
            if self.abandon is not None and self.abandon.is_set():
                # The full check reads every deferred byte again: never inside torch once the save was abandoned.
                raise CheckpointError("staging abandoned: the save was abandoned at close")
            if self.guard != GuardMode.OFF:
                self._check_guard()
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised on the training thread
            self.error = exc
        finally:
            self._guard.release()  # pages still write-protected (a failed or abandoned copy): never left armed
            for state in self.fences.values():
                state.event.set()
            self.stage_ended = time.perf_counter()
            self.staging_s = self.stage_ended - self.stage_started
            self.done.set()
        if self.huge_pages and self.error is None:  # after the protection was lifted: collapse skips armed pages
            host = [s for s in self._deferred if s.device.type == "cpu" and not s.storage.is_shared()]
            host = [s for s in host if not pinned(s.storage)]
            spans = [(s.storage.data_ptr(), s.nbytes) for s in host]
            self.huge_page_thread = advise_in_background(spans, [s.storage for s in host])

    def _release(self, fence: Fence) -> None:
        self.fences[fence].event.set()
        if self.on_release is not None:
            self.on_release(fence)

    def _check_guard(self) -> None:
        self._refuse_if_torn(self._guard.check(self.buffers, self.staged_sums))

    def staged_checksums(self) -> dict[int, int]:
        """CRC-32C of each staged host buffer whose copy computed it, by the buffer's address (after :meth:`run`).

        A writer given a view that is exactly such a buffer checksums it without reading it again.
        """
        out: dict[int, int] = {}
        for index, sums in self.staged_sums.items():
            buf, value = self.buffers[index], 0
            nbytes = buf.numel() * buf.element_size()
            for k, chunk in enumerate(sums):
                value = crc32c_combine(value, chunk, min(FINGERPRINT_CHUNK, nbytes - k * FINGERPRINT_CHUNK))
            out[buf.data_ptr()] = value
        return out

    def observe(self) -> None:
        """On the training thread: once staging finished, read the version counters of every fence not reached.

        Sound at any training-thread point after the copies landed: a write that ran during a copy has returned
        (its counter bump visible), and a write after this point cannot have reached the copy.
        """
        if not self.done.is_set():
            return
        for fence, state in self.fences.items():
            if not state.guard_read:
                state.guard_read = True
                self._guard.at_fence([s for s in self._deferred if s.fence == fence])

    def confirm(self) -> None:
        """Right before the manifest is written: refuse if a deferred tensor was written before its fence.

        Raises:
            TornSnapshotError: a version counter moved between the cut and the slot's fence (or now, when the
                training thread has not reached that fence yet).
        """
        self._refuse_if_torn(
            self._guard.confirm(),
            hint="; in a plain loop, call drain() (or pass a fence) after the last save before writing parameters "
            "outside the optimizer",
        )

    def _refuse_if_torn(self, found: list, hint: str = "") -> None:
        if found:
            torn = [slot for slot, _ in found]
            self.torn_categories = {s.category for s in torn}
            names = ", ".join(f"{slot.names[0]} ({how})" for slot, how in found[:5])
            raise TornSnapshotError(
                f"{len(torn)} deferred storage(s) changed between the cut and their staging copy ({names}); the "
                f"deferral proof for {sorted(c.value for c in self.torn_categories)} failed, the checkpoint was "
                "refused and those categories are now copied at the cut" + hint
            )

    # -- at a fence, on the training thread --------------------------------------------------------------
    def wait(self, fence: Fence) -> float:
        """Block until every storage fenced at ``fence`` (or earlier) is staged; returns seconds blocked.

        On CUDA the compute stream waits on the copy's event instead of the host, once the copies were issued.
        """
        waited = 0.0
        for f in (Fence.BATCH_START, Fence.OPTIMIZER_STEP):
            state = self.fences[f]
            if not state.event.is_set():
                t0 = time.perf_counter()
                state.event.wait()
                state.waited_s += time.perf_counter() - t0
                waited += time.perf_counter() - t0
            if state.cuda_events:
                for dev, event in state.cuda_events.items():
                    torch.cuda.current_stream(dev).wait_event(event)
                state.cuda_events = {}
            if not state.guard_read:
                state.guard_read = True
                self._guard.at_fence([s for s in self._deferred if s.fence == f])
            if f == fence:
                break
        return waited

    @property
    def deferred_bytes(self) -> int:
        """Bytes staged in the background."""
        return sum(s.nbytes for s in self._deferred)
