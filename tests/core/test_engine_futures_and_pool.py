"""Engine behaviours fixed with the core split (issue 11) and the pool pre-allocation (issue 16 item 2).

Asserted through public futures, records, events and pool statistics only.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer, TorchSaveSerializer
from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.errors import CheckpointError, HostMemoryBudgetError
from lightning_async_ckpt.storage.store import CheckpointStore, GenerationWriter

REPO = Path(__file__).resolve().parents[2]


class FailingSerializer:
    """Waits for ``gate``, then fails every attempt with a numbered ``OSError``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0

    def write(self, state: Any, writer: GenerationWriter) -> None:
        self.calls += 1
        self.gate.wait()
        raise OSError(errno.EIO, f"boom {self.calls}")


@pytest.fixture
def ckpts(tmp_path: Path) -> Iterator[list[AsyncCheckpointer]]:
    made: list[AsyncCheckpointer] = []
    yield made
    for ckpt in made:
        if isinstance(ckpt.serializer, FailingSerializer):
            ckpt.serializer.gate.set()
        try:
            ckpt.close()
        except CheckpointError:
            pass


def _make(ckpts: list, tmp_path: Path, **overrides: Any) -> AsyncCheckpointer:
    overrides.setdefault("host_memory_budget", None)
    overrides.setdefault("retries", 0)
    ckpt = AsyncCheckpointer(CheckpointStore(str(tmp_path / "ckpt")), **overrides)
    ckpts.append(ckpt)
    return ckpt


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(6, 8)).pow(2).mean().backward()
    opt.step()  # the optimizer state exists from here on
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _two_failed_saves(ckpts: list, tmp_path: Path) -> AsyncCheckpointer:
    ckpt = _make(ckpts, tmp_path, serializer=FailingSerializer(), max_outstanding=2)
    first, second = ckpt.save(1, {"w": torch.ones(4)}), ckpt.save(2, {"w": torch.ones(4)})
    ckpt.serializer.gate.set()
    assert first.committed.exception() is not None and second.committed.exception() is not None
    assert ckpt.pending_errors == 2
    return ckpt


def test_a_second_background_error_is_not_dropped_each_is_raised_once_oldest_first(ckpts, tmp_path) -> None:
    ckpt = _two_failed_saves(ckpts, tmp_path)
    with pytest.raises(CheckpointError, match="boom 1"):
        ckpt.poll()
    with pytest.raises(CheckpointError, match="boom 2"):
        ckpt.poll()
    ckpt.poll()  # both delivered: nothing left
    assert [r.outcome for r in ckpt.records] == ["failed", "failed"]


def test_close_raises_the_first_pending_error_and_names_the_others(ckpts, tmp_path) -> None:
    ckpt = _two_failed_saves(ckpts, tmp_path)
    with pytest.raises(CheckpointError, match="boom 1") as info:
        ckpt.close()
    assert any("boom 2" in note for note in getattr(info.value, "__notes__", []))
    assert ckpt.pending_errors == 0


def test_a_capture_failure_after_admission_still_leaves_an_outcome_record(ckpts, tmp_path) -> None:
    ckpt = _make(ckpts, tmp_path, host_memory_budget=1_024)
    with pytest.raises(HostMemoryBudgetError):
        ckpt.save(3, {"w": torch.zeros(4_096)})
    record = ckpt.records[-1]
    assert (record.requested_step, record.decision, record.outcome) == (3, "admit", "failed")
    assert record.error is not None and record.error.startswith("HostMemoryBudgetError")
    saves = [e for e in ckpt.events.events if e["event"] == "save"]
    assert [(e["requested_step"], e["outcome"]) for e in saves] == [(3, "failed")]
    assert ckpt.outstanding == 0


def test_a_blocking_fence_wait_is_emitted_as_a_fence_wait_event(ckpts, tmp_path, monkeypatch) -> None:
    gate = threading.Event()
    run = StagingJob.run

    def gated_run(job: StagingJob) -> None:
        gate.wait()
        run(job)

    monkeypatch.setattr(StagingJob, "run", gated_run)
    ckpt = _make(ckpts, tmp_path)
    model, opt = _model()
    ckpt.attach(model, opt)
    handle = ckpt.save(5, _state(model, opt), modules=[model], optimizers=[opt])
    fence = handle.staging.fences[Fence.BATCH_START]
    real_wait = fence.event.wait

    def wait_then_release(timeout: float | None = None) -> bool:
        gate.set()  # staging may start only once the training thread blocks at the fence
        return real_wait(timeout)

    fence.event.wait = wait_then_release  # type: ignore[method-assign]
    waited = ckpt.wait(Fence.BATCH_START)
    assert waited > 0
    events = [e for e in ckpt.events.events if e["event"] == "fence_wait"]
    assert len(events) == 1
    assert events[0]["fence"] == "batch_start" and events[0]["steps"] == [5]
    assert events[0]["wait_s"] == pytest.approx(waited)  # the key `lightning-async-ckpt timeline` draws
    handle.result()
    assert handle.record.fence_wait_s["batch_start"] == pytest.approx(waited)


def test_preallocation_before_the_first_cut_means_its_acquire_allocates_nothing(ckpts, tmp_path) -> None:
    ckpt = _make(ckpts, tmp_path)
    model, opt = _model()
    reserved = ckpt.preallocate(_state(model, opt), modules=[model], optimizers=[opt]).result()
    allocations = ckpt.pool.allocations
    assert reserved > 0 and allocations > 0
    assert ckpt.pool.allocations_at_cut == 0
    assert ckpt.pool.retained_bytes == reserved

    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt])
    assert ckpt.pool.allocations_at_cut == 0  # the first cut reused every reserved buffer
    assert ckpt.pool.allocations == allocations
    assert handle.plan.total_bytes == reserved == ckpt.pool.retained_bytes
    handle.result()
    ckpt.save(2, _state(model, opt), modules=[model], optimizers=[opt]).result()
    assert ckpt.pool.allocations == allocations


def test_preallocation_is_idempotent_and_bounded_by_the_budget(ckpts, tmp_path) -> None:
    model, opt = _model()
    state = _state(model, opt)
    ckpt = _make(ckpts, tmp_path)
    first = ckpt.preallocate(state, modules=[model], optimizers=[opt]).result()
    assert ckpt.preallocate(state, modules=[model], optimizers=[opt]).result() == 0  # already free
    small = _make(ckpts, tmp_path, host_memory_budget=first // 2)
    with pytest.raises(HostMemoryBudgetError):
        small.preallocate(state, modules=[model], optimizers=[opt])
    assert small.pool.retained_bytes == 0


def test_retake_is_due_after_a_torn_save_until_the_next_admitted_one(ckpts, tmp_path) -> None:
    from lightning_async_ckpt.core.capture import Category, DeferralProof

    gate = threading.Event()
    model, opt = _model()
    ckpt = _make(ckpts, tmp_path)
    ckpt.attach(model, opt)
    wrong = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("asserted by the test",))
    run = StagingJob.run

    def gated_run(job: StagingJob) -> None:
        gate.wait()
        run(job)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StagingJob, "run", gated_run)
        handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt], proof=wrong)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # written before the staging copy: the guard must refuse the save
        gate.set()
        assert handle.committed.exception() is not None
    assert handle.outcome == "torn"
    assert ckpt.retake_due
    ckpt.save(2, _state(model, opt), modules=[model], optimizers=[opt]).result()
    assert not ckpt.retake_due


def test_exit_hooks_run_newest_first_hold_owners_weakly_and_can_be_unregistered() -> None:
    script = """
from lightning_async_ckpt.core.workers import register_at_exit
class Owner:
    def __init__(self, name): self.name = name
    def bye(self): print("bye", self.name, flush=True)
a, b, gone, off = Owner("a"), Owner("b"), Owner("gone"), Owner("off")
register_at_exit(a.bye)
register_at_exit(gone.bye)
register_at_exit(b.bye)
register_at_exit(off.bye).unregister()
register_at_exit(lambda: print("function", flush=True))
del gone
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=str(REPO), check=True
    )
    assert proc.stdout.split("\n")[:-1] == ["function", "bye b", "bye a"]


def test_serializer_misuse_is_a_usage_error_that_is_not_retried(ckpts, tmp_path) -> None:
    class TwiceSerializer:
        calls = 0

        def write(self, state: Any, writer: GenerationWriter) -> None:
            TwiceSerializer.calls += 1
            TorchSaveSerializer().write(state, writer)
            TorchSaveSerializer().write(state, writer)  # opens the same object twice

    ckpt = _make(ckpts, tmp_path, serializer=TwiceSerializer(), retries=3)
    handle = ckpt.save(1, {"w": torch.ones(4)})
    assert isinstance(handle.committed.exception(), CheckpointError)
    assert TwiceSerializer.calls == 1
    assert handle.outcome == "failed"
    with pytest.raises(CheckpointError, match="already written"):
        ckpt.poll()


def test_a_cut_taken_while_the_reservation_still_runs_waits_for_it_instead_of_allocating(ckpts, tmp_path) -> None:
    ckpt = _make(ckpts, tmp_path)
    model, opt = _model()
    gate = threading.Event()
    ckpt.stage_worker.submit(gate.wait)  # the reservation queues behind this on the staging thread
    reservation = ckpt.preallocate(_state(model, opt), modules=[model], optimizers=[opt])
    assert not reservation.done()
    releaser = threading.Thread(target=gate.set, name="test-releaser")
    releaser.start()  # whichever comes first, the cut's acquire must not allocate on its own
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt])
    releaser.join()
    assert reservation.done() and reservation.result() == handle.plan.total_bytes
    assert ckpt.pool.allocations_at_cut == 0
    handle.result()
