"""How a cut is captured on the training thread: the engine's one capture step, with the layout plugged in.

The engine (:class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`) owns one capturer. At each admitted
cut it calls :meth:`Capturer.capture`, which classifies the state (the deferral proof and the capture plan of
:mod:`~lightning_async_ckpt.core.capture`), takes host buffers from the pool, copies what must be copied at the
cut and fingerprints the rest (:class:`~lightning_async_ckpt.core.staging.StagingJob`). What differs between
layouts is only how tensors are seen: :class:`PlainCapturer` takes them as they are; the sharded capturer
(:class:`~lightning_async_ckpt.sharded.capture.ShardedCapturer`) captures DTensors through their local shards and
rebuilds them around the staged copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence, prove_deferral
from lightning_async_ckpt.core.staging import BufferPool, StagingJob

__all__ = ["CutCapture", "PlainCapturer", "take_buffers"]


@dataclass
class CutCapture:
    """One rank's capture of one cut: the plan, its staging job and the pooled buffers it fills.

    Attributes:
        plan: The capture plan (``plan.describe()`` prints it).
        job: The staging job: copy-at-cut storages are already copied; ``job.run()`` copies the rest.
        buffers: The pool's buffers (released once the persister stopped reading them).
    """

    plan: CapturePlan
    job: StagingJob
    buffers: list[torch.Tensor]

    def staged_state(self) -> Any:
        """The state over the staged buffers (after ``job`` finished)."""
        return self.plan.materialize(self.buffers)


class PlainCapturer:
    """Captures state whose tensors are plain tensors (one process, DDP, Accelerate, plain loops).

    The modules and optimizers a save classifies are the ones passed to that save (:meth:`bind` is a no-op here:
    a plain loop passes them to ``save``).
    """

    def __init__(self) -> None:
        self._side_streams: dict[torch.device, Any] = {}

    def bind(self, modules: Sequence[Any], optimizers: Sequence[Any]) -> None:
        """Ignored: the plain layout classifies what each save names."""

    def capture(
        self,
        state: Any,
        *,
        modules: Sequence[Any],
        optimizers: Sequence[Any],
        proof: DeferralProof | None,
        defer: bool,
        fences: Iterable[Fence],
        demoted: set[Category],
        pool: BufferPool,
        guard: bool | str,
    ) -> CutCapture:
        """Classify ``state``, copy what must be copied at the cut, and return the staging job.

        Args:
            state: Nested containers of tensors and Python objects; tensors may alias live memory.
            modules: Modules whose parameters and buffers appear in ``state``.
            optimizers: Optimizers whose state appears in ``state``.
            proof: A deferral proof from the caller; ``None``: proven here from the fences the caller passes.
            defer: ``False`` copies everything at the cut.
            fences: The fences the caller calls ``wait`` at.
            demoted: Categories whose deferral failed the guard before: copied at the cut.
            pool: Where host buffers come from.
            guard: The guard mode (:mod:`lightning_async_ckpt.core.guard`).

        Returns:
            The capture; the engine runs ``capture.job.run()`` on its staging thread.
        """
        modules, optimizers = list(modules or ()), list(optimizers or ())
        if proof is None and defer:
            fences = set(fences)
            proof = prove_deferral(
                modules,
                optimizers,
                has_optimizer_step_fence=Fence.OPTIMIZER_STEP in fences,
                has_batch_start_fence=Fence.BATCH_START in fences,
            )
        # A proof without fences only says why everything is copied at the cut (e.g. the final checkpoint).
        keep = proof is not None and (defer or not proof.fences)
        plan = CapturePlan.build(
            state, modules=modules, optimizers=optimizers, proof=proof if keep else None, demoted=demoted
        )
        return take_buffers(plan, pool, guard, self._streams_for(plan))

    def _streams_for(self, plan: CapturePlan) -> dict[torch.device, Any]:
        for slot in plan.slots:
            if slot.device.type == "cuda" and slot.device not in self._side_streams:
                self._side_streams[slot.device] = torch.cuda.Stream(slot.device)
        return self._side_streams


def take_buffers(
    plan: CapturePlan, pool: BufferPool, guard: bool | str, streams: dict[torch.device, Any] | None = None
) -> CutCapture:
    """Take ``plan``'s buffers from ``pool`` and run the copy at the cut (the buffers go back on failure)."""
    pool.check(plan.total_bytes)
    buffers = pool.acquire(plan.slots)
    job = StagingJob(plan.slots, buffers, guard=guard)
    try:
        job.copy_at_cut(streams)
    except BaseException:
        pool.release(buffers)
        raise
    return CutCapture(plan=plan, job=job, buffers=buffers)
