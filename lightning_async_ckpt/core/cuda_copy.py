"""The CUDA side of staging: every device-to-host copy is enqueued at the cut, none is issued later.

Copy-at-cut storages are copied on the compute stream and deferred ones on a side stream that waits on the cut's
event; issuing them all on the training thread avoids a GIL hand-over per storage. A fence is a completion event
per device that the compute stream waits on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_async_ckpt.core.capture import Fence, StorageSlot

__all__ = ["CudaCopies", "as_bytes"]


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat ``uint8`` view of a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class CudaCopies:
    """The device-to-host copies of one checkpoint and the events that say where they are.

    Attributes:
        cut_events: Per device, an event on the compute stream right after the cut (and its copy-at-cut copies).
        fence_events: Per fence, per device, an event on the side stream after that fence's deferred copies.
    """

    def __init__(self) -> None:
        self.cut_events: dict[torch.device, torch.cuda.Event] = {}
        self.fence_events: dict[Fence, dict[torch.device, torch.cuda.Event]] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy_at_cut(self, slot: StorageSlot, buf: torch.Tensor) -> bool:
        """Enqueue one copy-at-cut storage on the compute stream; False when ``buf`` is not pinned (copy it)."""
        if not buf.is_pinned():
            return False
        buf.copy_(as_bytes(slot.storage), non_blocking=True)
        return True

    def mark_cut(self, devices: set[torch.device]) -> None:
        """Record the cut on each device's compute stream."""
        for dev in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            self.cut_events[dev] = event

    def issue_deferred(
        self,
        slots: Sequence[StorageSlot],
        buffers: Sequence[torch.Tensor],
        side_streams: dict[torch.device, torch.cuda.Stream] | None,
    ) -> None:
        """Enqueue the deferred CUDA copies on side streams after the cut, earlier fences first."""
        for dev in {s.device for s in slots}:
            stream = (side_streams or {}).get(dev) or torch.cuda.Stream(dev)
            stream.wait_event(self.cut_events[dev])
            self.streams[dev] = stream
        for fence in (Fence.BATCH_START, Fence.OPTIMIZER_STEP):
            mine = [s for s in slots if s.fence == fence]
            for slot in mine:
                stream = self.streams[slot.device]
                src = as_bytes(slot.storage)
                # The caching allocator must not hand this memory to a new tensor before the side stream read it.
                src.record_stream(stream)
                with torch.cuda.stream(stream):
                    buffers[slot.index].copy_(src, non_blocking=True)
            if mine:
                events = {}
                for dev in {s.device for s in mine}:
                    event = torch.cuda.Event()
                    event.record(self.streams[dev])
                    events[dev] = event
                self.fence_events[fence] = events

    def synchronize(self) -> None:
        """Block the calling (staging) thread until every copy landed in its host buffer."""
        for event in self.cut_events.values():
            event.synchronize()
        for stream in self.streams.values():
            stream.synchronize()
