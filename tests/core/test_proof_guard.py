"""The runtime guard: version counters catch every write through a tensor operation before the seal, the sampled
fingerprint misses with the documented probability, and the full checksum catches any changed word."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.guard import (
    FINGERPRINT_SAMPLES,
    GuardMode,
    checksum,
    miss_probability,
    resolve_guard_mode,
)
from lightning_async_ckpt.core.staging import BufferPool, StagingJob
from lightning_async_ckpt.errors import ConfigError, TornSnapshotError

# A float32 whose four bytes are all 0x01: writing it over zeros changes every byte of the element.
ALL_BYTES_SET = torch.tensor([0x01010101], dtype=torch.int32).view(torch.float32).item()
PROVEN = DeferralProof(
    fences={Category.PARAMETER: Fence.OPTIMIZER_STEP, Category.BUFFER: Fence.BATCH_START}, rules=("test",)
)


def _job(weight: torch.Tensor, guard: bool | str = "sample") -> tuple[CapturePlan, StagingJob]:
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(weight, requires_grad=False)
    model.weight.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = CapturePlan.build(
        {"weight": model.weight.detach()}, modules=[model], optimizers=[opt], proof=PROVEN
    )  # detached like a state dict: shares the version counter
    assert plan.slots[0].fence == Fence.OPTIMIZER_STEP
    job = StagingJob(plan.slots, BufferPool(None).acquire(plan.slots), guard=guard)
    return plan, job


def test_a_sparse_row_write_between_cut_and_copy_is_caught_by_the_version_counter():
    # One 256-byte row of a 4 MB table: the sampled fingerprint alone would miss it with probability
    # miss_probability(4 MB, 256) = 0.996; the version counter always sees it.
    weight = torch.randn(16_384, 64)
    assert miss_probability(weight.numel() * 4, 256) > 0.99
    for _ in range(10):
        _, job = _job(weight)
        job.copy_at_cut()
        with torch.no_grad():
            job.slots[0].tensors[0].index_fill_(0, torch.tensor([9_000]), 0.5)  # in place: bumps _version
        job.run()
        assert job.error is not None and "version counter" in str(job.error)
        assert job.torn_categories == {Category.PARAMETER}


def test_writes_after_the_fence_opened_do_not_count():
    # The optimizer's own step bumps _version after the fence: the seal happened before the fence opened.
    weight = torch.randn(1024, 64)
    for _ in range(10):
        plan, job = _job(weight)
        expected = weight.clone()
        job.copy_at_cut()
        thread = threading.Thread(target=job.run, name="lightning_async_ckpt-test-stage")
        thread.start()
        job.wait(Fence.OPTIMIZER_STEP)
        with torch.no_grad():
            weight.mul_(0.5)
        thread.join()
        assert job.error is None
        assert torch.equal(plan.materialize(job.buffers)["weight"], expected)
        weight.copy_(expected)


def test_sampled_fingerprint_detection_rate_matches_the_documented_probability():
    # `.data` writes do not bump the version counter: only the fingerprint can see them.
    n_bytes, changed, trials = 4096, 64, 1500
    p_miss = miss_probability(n_bytes, changed)
    assert p_miss == pytest.approx((1 - changed / n_bytes) ** FINGERPRINT_SAMPLES)
    weight = torch.zeros(n_bytes // 4)
    missed = 0
    for trial in range(trials):
        _, job = _job(weight)
        job.copy_at_cut()
        start = (trial * 37) % (weight.numel() - changed // 4)
        weight.data[start : start + changed // 4] = ALL_BYTES_SET  # 64 bytes change, _version does not
        job.run()
        missed += job.error is None
        weight.data.zero_()
    rate = missed / trials
    sd = (p_miss * (1 - p_miss) / trials) ** 0.5
    assert abs(rate - p_miss) < 5 * sd, f"measured miss rate {rate:.3f}, documented {p_miss:.3f} (sd {sd:.3f})"


def test_full_checksum_catches_every_single_word_change_that_bypasses_the_counter():
    weight = torch.zeros(1000)  # 4000 bytes: one word changed is missed by samples with p=0.88
    for i in range(0, 1000, 50):
        _, job = _job(weight, guard="full")
        job.copy_at_cut()
        weight.data[i] = 1e-30
        job.run()
        assert job.error is not None and "checksum" in str(job.error)
        weight.data.zero_()
    _, job = _job(weight, guard="full")
    job.copy_at_cut()
    job.run()
    assert job.error is None


def test_checksum_sees_any_single_word_and_tail_byte_change():
    data = torch.randint(0, 256, (8 * 1000 + 5,), dtype=torch.uint8)
    base = checksum(data)
    for i in [0, 7, 8, 4000, 7999, 8000, 8004]:
        changed = data.clone()
        changed[i] ^= 0x10
        assert checksum(changed) != base


@pytest.mark.parametrize(("value", "mode"), [(True, "full"), (False, "off"), ("full", "full"), ("sample", "sample")])
def test_guard_settings_name_a_mode(value, mode):
    assert resolve_guard_mode(value) is GuardMode(mode)


def test_an_unknown_guard_setting_names_the_choices():
    with pytest.raises(ConfigError, match="'sample', 'full'"):
        resolve_guard_mode("paranoid")


def test_a_write_whose_counter_bump_lands_after_the_seal_is_refused_before_the_commit():
    # The race the seal alone cannot see: an in-place write still running while its row is copied (the copy
    # reads half-written bytes) bumps the version counter only when it returns, after the copy landed and the
    # counters were sealed. Emulated deterministically: the staged row is torn by hand, then the source is
    # written in place (the bump) before the training thread reaches the fence. The sampled fingerprint misses a
    # 256-byte row of a 4 MB table with probability 0.996; the counter read at the fence, or before the commit
    # when the fence was not reached yet, always sees it.
    weight = torch.randn(16_384, 64)
    for reach_fence_first in (False, True):
        for _ in range(5):
            _, job = _job(weight)
            job.copy_at_cut()
            job.run()
            assert job.error is None  # seal and fingerprint saw nothing
            job.buffers[0].view(torch.float32).view(16_384, 64)[9_000] = 0.25  # the torn row in the staged copy
            with torch.no_grad():
                job.slots[0].tensors[0].index_fill_(0, torch.tensor([9_000]), 0.5)  # its bump, after the seal
            if reach_fence_first:
                job.wait(Fence.OPTIMIZER_STEP)
                with torch.no_grad():
                    weight.mul_(1.0)  # the optimizer's own write after the fence does not hide the earlier one
            with pytest.raises(TornSnapshotError, match="before its fence"):
                job.confirm()
            assert job.torn_categories == {Category.PARAMETER}


def test_confirm_accepts_writes_after_the_fence():
    weight = torch.randn(1024, 64)
    _, job = _job(weight)
    job.copy_at_cut()
    job.run()
    job.wait(Fence.OPTIMIZER_STEP)
    with torch.no_grad():
        weight.mul_(0.5)  # the optimizer step after the fence
    job.confirm()  # no error


def _proof_failures(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[str, ...]:
    from lightning_async_ckpt.core.proof import prove_deferral
    from lightning_async_ckpt.sharded.capture import sharded_proof

    single = prove_deferral([model], [opt]).failures
    # The sharded path (FSDP2, DDP slices) uses the same rules.
    assert sharded_proof([model], [opt], {Fence.OPTIMIZER_STEP, Fence.BATCH_START}).failures == single
    return single


def test_torch_optimizers_with_an_lr_scheduler_are_proven():
    model = torch.nn.Linear(4, 4)
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = cls(model.parameters(), lr=0.1)
        torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps opt.step on the instance: torch's own
        assert _proof_failures(model, opt) == ()

    class Configured(torch.optim.Adam):  # a subclass that keeps torch's step
        pass

    assert _proof_failures(model, Configured(model.parameters())) == ()


def test_code_that_runs_inside_optimizer_step_before_the_closure_is_named():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from lightning_async_ckpt.core.hooks import FenceHooks

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    FenceHooks(lambda fence: 0.0).attach(model, opt)  # our own fences only wait: never a failure
    assert _proof_failures(model, opt) == ()
    handle = opt.register_step_pre_hook(lambda *a: None)
    assert any("1 step pre-hook" in f for f in _proof_failures(model, opt))
    handle.remove()
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert any("global optimizer step pre-hook" in f for f in _proof_failures(model, opt))
    finally:
        handle.remove()

    class Lookahead(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert any("overrides step" in f for f in _proof_failures(model, Lookahead(model.parameters(), lr=0.1)))
    replaced = torch.optim.SGD(model.parameters(), lr=0.1)
    replaced.step = lambda closure=None: None
    assert any("replaced on the instance" in f for f in _proof_failures(model, replaced))
    model.weight.register_hook(lambda grad: grad)
    assert any("gradient hook" in f for f in _proof_failures(model, opt))


def test_the_device_side_partials_combine_to_the_host_checksum(monkeypatch):
    # The device path (run here on CPU tensors: the same torch ops) must agree with the numpy checksum the staging
    # thread computes on the staged copy, for sizes with and without tail bytes, across chunk boundaries and across
    # the boundaries of the groups of chunks reduced together (two chunks a group here).
    from lightning_async_ckpt.core import fingerprint
    from lightning_async_ckpt.core.guard import _CHUNK_WORDS, combine_partials, device_partials

    monkeypatch.setattr(fingerprint, "_GROUP_CHUNKS", 2)
    g = torch.Generator().manual_seed(0)
    for n in (0, 7, 8, 1000 * 8 + 5, 8 * _CHUNK_WORDS + 3, 8 * 2 * _CHUNK_WORDS + 8, 8 * 5 * _CHUNK_WORDS + 13):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert combine_partials(device_partials(data).tolist()) == checksum(data), n
