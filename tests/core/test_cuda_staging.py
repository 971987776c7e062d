"""CUDA staging path: pinned buffers, a side stream ordered after the cut, fences as stream waits.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``pytest tests/core/test_cuda_staging.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.storage.store import CheckpointStore

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt):
    loss = model(torch.randn(64, 256, device="cuda")).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_deferred_cuda_state_is_staged_into_pinned_buffers_and_equals_the_cut(tmp_path):
    model, opt = _model_and_opt()
    _step(model, opt)
    with AsyncCheckpointer(CheckpointStore(str(tmp_path)), host_memory_budget=None) as ckpt:
        ckpt.attach(model, opt)
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        handle = ckpt.save(
            1, {"model": model.state_dict(), "optim": opt.state_dict()}, modules=[model], optimizers=[opt]
        )
        assert handle.record.deferred_bytes > 0
        for _ in range(3):  # the hooks fence: the compute stream waits for the side-stream copies
            _step(model, opt)
        manifest = handle.result(timeout=60)
        assert ckpt.pool.retained_bytes > 0
    with CheckpointStore(str(tmp_path)).open(manifest.step, "checkpoint.ckpt") as f:
        saved = torch.load(f, map_location="cpu")
    for key, value in expected.items():
        assert torch.equal(saved["model"][key], value), key


def test_staging_buffers_are_pinned_and_reused(tmp_path):
    model, opt = _model_and_opt()
    _step(model, opt)
    with AsyncCheckpointer(CheckpointStore(str(tmp_path)), host_memory_budget=None) as ckpt:
        ckpt.attach(model, opt)
        retained = []
        for step in range(1, 6):
            handle = ckpt.save(
                step, {"model": model.state_dict(), "optim": opt.state_dict()}, modules=[model], optimizers=[opt]
            )
            handle.staging.wait(Fence.OPTIMIZER_STEP)
            job = handle.staging
            # Buffers of CUDA storages are pinned (the D2H copy is asynchronous only into pinned memory). The
            # optimizer's `step` counters live on the CPU: their buffers are plain host memory, copied by memcpy.
            cuda = [buf for slot, buf in zip(job.slots, job.buffers, strict=True) if slot.device.type == "cuda"]
            assert cuda and all(buf.is_pinned() for buf in cuda)
            _step(model, opt)
            handle.result(timeout=60)
            retained.append(ckpt.pool.retained_bytes)
        assert len(set(retained[1:])) == 1 and retained[-1] == retained[0]


def test_fence_does_not_block_the_host_on_cuda(tmp_path):
    model, opt = _model_and_opt()
    _step(model, opt)
    with AsyncCheckpointer(CheckpointStore(str(tmp_path)), host_memory_budget=None) as ckpt:
        ckpt.attach(model, opt)
        handle = ckpt.save(1, {"model": model.state_dict()}, modules=[model], optimizers=[opt])
        handle.staging.fences[Fence.OPTIMIZER_STEP].event.wait(timeout=60)  # copies issued on the side stream
        assert handle.wait(Fence.OPTIMIZER_STEP) == 0.0  # the compute stream waits on the event, not the host
        _step(model, opt)
        handle.result(timeout=60)


def test_a_data_write_between_the_cut_and_the_copy_is_refused_on_cuda():
    # A `.data` write bypasses the version counter: only the exact guard's device-side fingerprint (enqueued on the
    # compute stream at the cut) can see it. To order the write before the deferred copy without a race, the copy's
    # side stream is first made busy (a device-side sleep), so the write enqueued after the cut on the compute stream
    # lands before the side stream copies; the staged copy is then checked to hold the written value (the ordering
    # took effect) and the checkpoint must be refused.
    from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof
    from lightning_async_ckpt.core.staging import BufferPool, StagingJob
    from lightning_async_ckpt.errors import TornSnapshotError

    proof = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("test",))
    for repeat in range(3):
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plan = CapturePlan.build({"weight": model.weight.detach()}, modules=[model], optimizers=[opt], proof=proof)
        assert plan.slots[0].fence == Fence.OPTIMIZER_STEP
        job = StagingJob(plan.slots, BufferPool(None).acquire(plan.slots), guard=True)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device time before the side stream may copy
        job.copy_at_cut({model.weight.device: side})
        model.weight.data[7, :] = 3.0 + repeat  # a `.data` write: no version-counter bump of the saved tensor
        job.run()
        staged = job.buffers[0].view(torch.float32).view(1024, 1024)
        assert torch.all(staged[7] == 3.0 + repeat), "the write did not land before the copy"
        assert isinstance(job.error, TornSnapshotError) and "changed between the cut" in str(job.error), job.error


def test_a_cuda_cut_with_no_write_is_not_refused():
    from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof
    from lightning_async_ckpt.core.staging import BufferPool, StagingJob

    proof = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("test",))
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = CapturePlan.build({"weight": model.weight.detach()}, modules=[model], optimizers=[opt], proof=proof)
    job = StagingJob(plan.slots, BufferPool(None).acquire(plan.slots), guard=True)
    expected = model.weight.detach().cpu().clone()
    job.copy_at_cut()
    job.run()
    assert job.error is None
    job.confirm()
    assert torch.equal(job.buffers[0].view(torch.float32).view(1024, 1024), expected)
