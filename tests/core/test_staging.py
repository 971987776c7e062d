"""Staging: pooled host buffers under a budget, copies at the cut and behind fences, and the fingerprint guard."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.staging import BufferPool, StagingJob, resolve_budget
from lightning_async_ckpt.errors import ConfigError, HostMemoryBudgetError, TornSnapshotError

DEFER_ALL = DeferralProof(
    fences={Category.PARAMETER: Fence.OPTIMIZER_STEP, Category.BUFFER: Fence.BATCH_START}, rules=("test",)
)


def _plan(weight: torch.Tensor, running: torch.Tensor, counter: torch.Tensor) -> CapturePlan:
    """A plan with one parameter (optimizer-step fence), one buffer (batch-start fence), one counter (cut)."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight)
    module.register_buffer("running", running)
    state = {"weight": module.weight, "running": module.running, "counter": counter}
    opt = torch.optim.SGD([module.weight], lr=0.1)
    return CapturePlan.build(state, modules=[module], optimizers=[opt], proof=DEFER_ALL)


def _job(plan: CapturePlan, pool: BufferPool | None = None, *, guard: bool = True) -> StagingJob:
    pool = pool or BufferPool(None)
    return StagingJob(plan.slots, pool.acquire(plan.slots), guard=guard)


def _run_in_thread(job: StagingJob) -> threading.Thread:
    thread = threading.Thread(target=job.run, name="test-stage")
    thread.start()
    return thread


# -- budget -----------------------------------------------------------------------------------------------
def test_resolve_budget_accepts_bytes_auto_and_none_and_subtracts_reserved_bytes() -> None:
    assert resolve_budget(None) is None
    assert resolve_budget(1000, reserved_bytes=300) == 700
    auto = resolve_budget("auto")
    assert isinstance(auto, int) and auto > 0
    assert resolve_budget("auto", reserved_bytes=auto + 1) == 0


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "lots", "AUTO"])
def test_resolve_budget_rejects_bad_values_naming_the_option(bad: object) -> None:
    with pytest.raises(ConfigError, match="host_memory_budget"):
        resolve_budget(bad)  # type: ignore[arg-type]


def test_pool_check_names_needed_and_allowed_bytes() -> None:
    pool = BufferPool(1_000)
    pool.check(1_000)
    with pytest.raises(HostMemoryBudgetError, match=r"needs 4,096 bytes.*allows 1,000.*available now: [\d,]+"):
        pool.check(4_096)


# -- buffer reuse -----------------------------------------------------------------------------------------
def test_pool_reuses_released_buffers_and_never_hands_out_one_in_use() -> None:
    plan = _plan(torch.randn(16), torch.zeros(8), torch.tensor(3))
    pool = BufferPool(None)
    first = pool.acquire(plan.slots)
    retained = pool.retained_bytes
    assert retained == plan.total_bytes
    second = pool.acquire(plan.slots)  # the first set is still being read by an upload
    assert {b.data_ptr() for b in first}.isdisjoint(b.data_ptr() for b in second)
    assert pool.retained_bytes == 2 * retained

    pool.release(first)
    third = pool.acquire(plan.slots)
    assert {b.data_ptr() for b in third} == {b.data_ptr() for b in first}
    assert pool.retained_bytes == 2 * retained
    assert pool.in_use_bytes == 2 * retained
    assert pool.peak_bytes == 2 * retained


def test_pool_trims_free_buffers_to_fit_the_budget_and_refuses_what_cannot_fit() -> None:
    small = CapturePlan.build({"a": torch.zeros(64)})  # 256 bytes
    large = CapturePlan.build({"b": torch.zeros(128)})  # 512 bytes
    pool = BufferPool(600)
    pool.release(pool.acquire(small.slots))
    assert pool.retained_bytes == 256
    held = pool.acquire(large.slots)  # needs the free 256-byte buffer dropped
    assert pool.retained_bytes == 512
    with pytest.raises(HostMemoryBudgetError, match="host_memory_budget of 600"):
        pool.acquire(small.slots)  # 512 in use + 256 > 600
    pool.release(held)
    pool.clear()
    assert pool.retained_bytes == 0


# -- copies and fences ------------------------------------------------------------------------------------
def test_copy_at_cut_slots_are_copied_before_copy_at_cut_returns() -> None:
    counter = torch.tensor(5)
    plan = _plan(torch.randn(16), torch.zeros(8), counter)
    job = _job(plan)
    job.copy_at_cut()
    counter.add_(1)  # mutated right after the cut, before any staging thread ran
    job.run()
    staged = plan.materialize(job.buffers)
    assert staged["counter"].item() == 5
    assert job.deferred_bytes == 16 * 4 + 8 * 4


def test_fences_release_once_their_storages_are_staged_and_snapshot_is_independent() -> None:
    weight, running = torch.randn(16), torch.randn(8)
    plan = _plan(weight, running, torch.tensor(0))
    job = _job(plan)
    job.copy_at_cut()
    assert not job.fences[Fence.BATCH_START].event.is_set()
    assert not job.fences[Fence.OPTIMIZER_STEP].event.is_set()
    expected_w, expected_r = weight.clone(), running.clone()

    thread = _run_in_thread(job)
    job.wait(Fence.BATCH_START)
    running.add_(1)  # the next forward may now update the buffer
    job.wait(Fence.OPTIMIZER_STEP)
    with torch.no_grad():
        weight.mul_(2)  # the optimizer may now update the parameter
    thread.join()

    assert job.error is None
    staged = plan.materialize(job.buffers)
    assert torch.equal(staged["weight"], expected_w)
    assert torch.equal(staged["running"], expected_r)
    assert staged["weight"].data_ptr() != weight.data_ptr()


def test_fence_without_deferred_storages_is_open_from_the_cut() -> None:
    plan = CapturePlan.build({"x": torch.randn(4)})  # nothing proven: all at the cut
    job = _job(plan)
    job.copy_at_cut()
    assert job.wait(Fence.OPTIMIZER_STEP) == 0.0  # would block forever if the fence were not open
    job.run()
    assert job.error is None


# -- the runtime guard ------------------------------------------------------------------------------------
def test_guard_refuses_a_snapshot_whose_deferred_storage_changed_before_staging() -> None:
    weight = torch.randn(32)
    plan = _plan(weight, torch.zeros(8), torch.tensor(0))
    job = _job(plan)
    job.copy_at_cut()
    with torch.no_grad():
        weight.add_(1)  # a write the proof did not foresee, before the staging copy
    job.run()
    assert isinstance(job.error, TornSnapshotError)
    assert "weight" in str(job.error)
    assert job.torn_categories == {Category.PARAMETER}
    # Fences never stay closed after a failure: the training thread cannot deadlock.
    assert job.fences[Fence.OPTIMIZER_STEP].event.is_set()


def test_guard_off_does_not_check() -> None:
    weight = torch.randn(32)
    plan = _plan(weight, torch.zeros(8), torch.tensor(0))
    job = _job(plan, guard=False)
    job.copy_at_cut()
    with torch.no_grad():
        weight.add_(1)
    job.run()
    assert job.error is None


def test_guard_fingerprints_storages_larger_than_float32_can_index() -> None:
    # 16 MiB + 4 bytes: the last sampled byte index (nbytes - 1) is not representable in float32.
    weight = torch.zeros((16 << 20) // 4 + 1)
    plan = _plan(weight, torch.zeros(8), torch.tensor(0))
    job = _job(plan)
    job.copy_at_cut()
    job.run()
    assert job.error is None

    job = _job(plan)
    job.copy_at_cut()
    weight[-1] = 1.0  # changes the storage's last byte, which the sample always includes
    job.run()
    assert isinstance(job.error, TornSnapshotError)


def _resident_fraction(buf: torch.Tensor) -> float:
    """Fraction of ``buf``'s pages present in memory (``/proc/self/pagemap``'s present bit), every 16th page."""
    page = 4096
    first, last = buf.data_ptr() // page + 1, (buf.data_ptr() + buf.numel()) // page - 1  # whole pages only
    pages = range(first, last, 16)
    present = 0
    with open("/proc/self/pagemap", "rb") as f:
        for p in pages:
            f.seek(p * 8)
            present += int.from_bytes(f.read(8), "little") >> 63
    return present / len(pages)


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="needs /proc/self/pagemap")
def test_reserved_buffers_are_faulted_in_before_the_first_cut() -> None:
    # Untouched buffers would fault on the first staging copy, while training runs (waited for at the first fence).
    plan = CapturePlan.build({"w": torch.ones(16 << 20)})  # one 64 MiB storage
    pool = BufferPool(None)
    assert pool.reserve(list(plan.slots)) == 64 << 20
    (buf,) = [b for bufs in pool._free.values() for b in bufs]
    assert _resident_fraction(buf) == 1.0
