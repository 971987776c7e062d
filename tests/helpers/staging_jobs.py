"""A staging job over one parameter whose copy is deferred to the optimizer-step fence (the guard in exact mode)."""

from __future__ import annotations

import torch

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.staging import BufferPool, StagingJob

DEFER = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("test",))


def deferred_job(weight: torch.nn.Parameter) -> StagingJob:
    """A job staging ``weight`` (a module's only parameter, under SGD) with its copy deferred; not started."""
    module = torch.nn.Module()
    module.weight = weight
    opt = torch.optim.SGD([module.weight], lr=0.1)
    plan = CapturePlan.build({"weight": module.weight}, modules=[module], optimizers=[opt], proof=DEFER)
    return StagingJob(plan.slots, BufferPool(None).acquire(plan.slots), guard=True)
