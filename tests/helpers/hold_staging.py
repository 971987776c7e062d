"""Hold the staging thread after a cut until a chosen write ran: a write after the cut lands before the copy."""

from __future__ import annotations

import threading

import lightning.pytorch as pl

from lightning_async_ckpt import AsyncCheckpointCallback
from lightning_async_ckpt.core.proof import FENCE_ORDER, Fence


class HoldStaging(pl.Callback):
    """Holds the staging thread after each cut until ``release`` (the write under test) or the first fence.

    Ordered before the checkpoint callbacks (Lightning puts them last), so its task is queued before the cut's copy.
    Declared read-only: it writes nothing. ``at``: hold only after the batch ends of these steps (default: every one
    but the last, or every one with ``last_too``).
    """

    lightning_async_ckpt_read_only = True

    def __init__(self, ours: AsyncCheckpointCallback, *, last_too: bool = False, at: set[int] | None = None) -> None:
        self.ours = ours
        self.last_too = last_too
        self.at = at
        self._patched = None
        self.gate = threading.Event()
        self.gate.set()
        self.held = 0

    def release(self) -> None:
        self.gate.set()

    def on_train_start(self, trainer, pl_module):
        self._patch()

    def _patch(self) -> None:
        # Also after the callback's on_train_start, which may open another engine (the local tier's location).
        ck = self.ours.checkpointer
        if ck is self._patched:
            return
        self._patched = ck
        wait_for, save = ck.wait, ck.save
        plans: list = []

        def wait(fence, **kwargs):
            # The training thread waits at a fence that holds deferred storages: the copy may run now.
            if plans and any(
                s.fence != Fence.CUT and FENCE_ORDER[s.fence] <= FENCE_ORDER[fence] for s in plans[-1].slots
            ):
                self.gate.set()
            return wait_for(fence, **kwargs)

        def save_and_remember(*args, **kwargs):
            handle = save(*args, **kwargs)
            plans.append(handle.plan)
            return handle

        ck.wait, ck.save = wait, save_and_remember

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._patch()
        if self.at is not None and trainer.global_step not in self.at:
            return
        if self.at is not None or self.last_too or trainer.global_step < trainer.max_steps:
            self.gate = threading.Event()
            self.held += 1
            self.ours.checkpointer.stage_worker.submit(self.gate.wait)

    def on_validation_end(self, trainer, pl_module):
        self.gate.set()

    def on_train_end(self, trainer, pl_module):
        self.gate.set()

    def on_exception(self, trainer, pl_module, exception):
        self.gate.set()
