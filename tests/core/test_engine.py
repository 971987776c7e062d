"""The engine: fenced deferral in a plain loop, the runtime guard, errors delivered once, admission, budget,
lifecycle, buffer reuse, telemetry and the three futures.

Background work is gated with ``threading.Event``s, never with sleeps: a serializer whose ``write`` blocks on a
gate (the upload thread), and gates on the staging thread (before a job copies anything, and between its
batch-start and optimizer-step storages).
"""

from __future__ import annotations

import copy
import errno
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_async_ckpt.core.capture import Category, DeferralProof, Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer, CheckpointOptions, TorchSaveSerializer
from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.errors import (
    AdmissionError,
    CheckpointError,
    ConfigError,
    HostMemoryBudgetError,
    ManifestError,
    TornSnapshotError,
)
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore, GenerationWriter

CKPT = "checkpoint.ckpt"
THREAD_PREFIX = "lightning_async_ckpt"


# -- gates ------------------------------------------------------------------------------------------------
def _open_gate() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


class GatedSerializer:
    """``torch.save`` into the generation, after ``gate`` opens; successive attempts may raise ``errors``.

    Attributes:
        gate: The upload thread blocks in ``write`` until it is set (open by default).
        entered: Set once ``write`` was entered.
        errors: Raised by the first attempts, in order (after the gate).
        calls: Attempts so far.
    """

    def __init__(self, *, gate_open: bool = True, errors: tuple[BaseException, ...] = ()) -> None:
        self.gate = _open_gate() if gate_open else threading.Event()
        self.entered = threading.Event()
        self.errors = list(errors)
        self.calls = 0

    def write(self, state: Any, writer: GenerationWriter) -> None:
        self.calls += 1
        self.entered.set()
        self.gate.wait()
        if self.errors:
            raise self.errors.pop(0)
        TorchSaveSerializer().write(state, writer)


class StagingGates:
    """Gates on the staging thread (installed by the ``staging_gates`` fixture; open by default).

    Attributes:
        before: A staging job waits on it before copying anything.
        after_batch_start: A job waits on it after its batch-start storages landed (their fence is released)
            and before it copies the optimizer-step ones.
    """

    def __init__(self) -> None:
        self.before = _open_gate()
        self.after_batch_start = _open_gate()

    def open_all(self) -> None:
        self.before.set()
        self.after_batch_start.set()

    def open_at_fences(self, ckpt: AsyncCheckpointer) -> None:
        """Open each gate only when the training thread reaches the matching fence and waits there.

        Staging then cannot start before the next forward reaches batch start, nor copy the optimizer-step
        storages before the optimizer reaches its step: if a fence did not wait, the mutation it should hold
        back would land first, every time.
        """
        gates = {Fence.BATCH_START: self.before, Fence.OPTIMIZER_STEP: self.after_batch_start}
        real = ckpt.wait

        def wait(fence: Fence, **kwargs: Any) -> float:
            gates[fence].set()
            return real(fence, **kwargs)

        ckpt.wait = wait  # type: ignore[method-assign]


@pytest.fixture
def staging_gates(monkeypatch: pytest.MonkeyPatch, make_ckpt: Any) -> Iterator[StagingGates]:
    # Depends on make_ckpt so that it is torn down first: the gates open before the checkpointers close.
    gates = StagingGates()
    run = StagingJob.run

    def after_release(fence: Fence) -> None:
        if fence is Fence.BATCH_START:
            gates.after_batch_start.wait()

    def gated_run(job: StagingJob) -> None:
        job.on_release = after_release
        gates.before.wait()
        run(job)

    monkeypatch.setattr(StagingJob, "run", gated_run)
    yield gates
    gates.open_all()


@pytest.fixture
def make_ckpt(tmp_path: Path) -> Iterator[Callable[..., AsyncCheckpointer]]:
    """Build checkpointers on a local store; at teardown open every gate and close them."""
    made: list[AsyncCheckpointer] = []

    def make(**overrides: Any) -> AsyncCheckpointer:
        overrides.setdefault("host_memory_budget", None)
        overrides.setdefault("retry_backoff_s", 0.0)
        ckpt = AsyncCheckpointer(CheckpointStore(str(tmp_path / "ckpt")), **overrides)
        made.append(ckpt)
        return ckpt

    yield make
    for ckpt in made:
        if isinstance(ckpt.serializer, GatedSerializer):
            ckpt.serializer.gate.set()
        try:
            ckpt.close()
        except CheckpointError:
            pass


def _call_before_waiting(future: Future, action: Callable[[], None]) -> None:
    """Run ``action`` on the thread that calls ``future.result()``, right before it blocks there.

    This is how a test knows, without sleeping, that the caller reached its blocking point (admission wait,
    drain): the engine waits on a save's ``committed`` future there.
    """
    real = future.result

    def result(timeout: float | None = None) -> Any:
        action()
        return real(timeout)

    future.result = result  # type: ignore[method-assign]


# -- model and loop ---------------------------------------------------------------------------------------
def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _batch() -> torch.Tensor:
    return torch.randn(6, 8)


def _forward_backward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(_batch()).pow(2).mean().backward()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _forward_backward(model, opt)
    opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int = 0) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "hparams": {"lr": 0.1}}


def _snapshot(state: Any) -> Any:
    """An independent copy of the values at the cut, to compare the checkpoint with."""
    return copy.deepcopy(state)


def _load(store: CheckpointStore, step: int) -> Any:
    with store.open(step, CKPT) as f:
        return torch.load(f, weights_only=True)


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _committed_steps(store: CheckpointStore) -> list[int]:
    return [g.step for g in store.generations()]


def _fences_by_category(handle: Any) -> dict[str, str]:
    return {row["category"]: row["fence"] for row in handle.plan.rows()}


# -- fenced deferral in a plain loop ----------------------------------------------------------------------
def test_attach_defers_parameters_to_the_optimizer_step_and_buffers_to_batch_start(make_ckpt) -> None:
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt])
    fences = _fences_by_category(handle)
    assert fences["parameter"] == "optimizer_step"
    assert fences["optimizer_state"] == "optimizer_step"
    assert fences["buffer"] == "batch_start"
    assert fences["counter"] == "cut"
    assert handle.record.deferred_bytes > 0
    handle.result()


def test_defer_false_copies_everything_at_the_cut(make_ckpt) -> None:
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt], defer=False)
    assert {slot.fence for slot in handle.plan.slots} == {Fence.CUT}
    assert handle.record.deferred_bytes == 0
    assert handle.record.sync_bytes == handle.plan.total_bytes
    handle.result()


def test_a_final_save_is_copied_at_the_cut_so_writes_after_the_loop_never_reach_it(make_ckpt, staging_gates) -> None:
    # The staging thread is held until after the write: a deferred save would copy the written bytes.
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    expected = copy.deepcopy(_state(model, opt))
    staging_gates.before.clear()
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt], final=True)
    assert {slot.fence for slot in handle.plan.slots} == {Fence.CUT}
    assert "ends training" in handle.plan.describe()
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(2.0)  # code after the loop, through .data (no version bump)
    staging_gates.before.set()
    handle.result()
    saved = _load(ckpt.store, 1)
    assert torch.equal(saved["model"]["0.weight"], expected["model"]["0.weight"])


def test_a_data_write_before_a_deferred_copy_is_refused_never_committed(make_ckpt, staging_gates) -> None:
    # Without final=True the last save is deferred; a .data write before its copy bumps no version counter and the
    # default (exact) guard refuses it: the commit never holds bytes other than the cut's.
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    staging_gates.before.clear()
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt])
    assert _fences_by_category(handle)["parameter"] == "optimizer_step"
    with torch.no_grad():
        next(model.parameters()).data[0, 0] += 1.0  # one 4-byte word of one parameter
    staging_gates.before.set()
    with pytest.raises(TornSnapshotError, match="checksum"):
        handle.result()


def test_without_fences_nothing_is_deferred(make_ckpt) -> None:
    model, opt = _model()
    ckpt = make_ckpt()  # no attach(): the engine knows of no fence the caller will call
    _train_step(model, opt)
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt])
    assert {slot.fence for slot in handle.plan.slots} == {Fence.CUT}
    handle.result()


def test_optimizer_step_after_the_fence_never_changes_the_saved_bytes(make_ckpt, staging_gates) -> None:
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    staging_gates.before.clear()
    staging_gates.after_batch_start.clear()
    staging_gates.open_at_fences(ckpt)
    state = _state(model, opt, step=1)
    at_cut = _snapshot(state)
    handle = ckpt.save(1, state, modules=[model], optimizers=[opt])
    assert _fences_by_category(handle)["parameter"] == "optimizer_step"

    # The next step: its forward waits at batch start for the buffers only; parameters stay unstaged.
    _forward_backward(model, opt)
    assert not handle.staged.done()
    opt.step()  # the optimizer-step fence holds the update until the parameters are staged

    weight_now = model[0].weight.detach()
    assert not torch.equal(weight_now, at_cut["model"]["0.weight"])  # the update did happen
    staging_gates.open_all()  # (already open, unless a fence failed to wait)
    manifest = handle.result()
    assert manifest.step == 1
    _assert_same(_load(ckpt.store, 1), at_cut)


@pytest.mark.parametrize("defer", [True, False], ids=["fenced_at_batch_start", "copied_at_cut"])
def test_batchnorm_running_stats_are_saved_as_at_the_cut_although_the_next_forward_ran_first(
    make_ckpt, staging_gates, defer: bool
) -> None:
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    bn = model[1]
    at_cut = {k: v.clone() for k, v in bn.state_dict().items()}
    staging_gates.before.clear()
    staging_gates.after_batch_start.clear()
    if defer:
        staging_gates.open_at_fences(ckpt)  # staging starts only once the forward waits at batch start
    # else nothing is staged at all while the next forward runs
    handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt], defer=defer)
    assert _fences_by_category(handle)["buffer"] == ("batch_start" if defer else "cut")

    model.train()
    model(_batch())  # train mode: updates running_mean, running_var and num_batches_tracked
    assert not handle.staged.done()  # staging has not finished
    assert bn.num_batches_tracked.item() == at_cut["num_batches_tracked"].item() + 1
    assert not torch.equal(bn.running_mean, at_cut["running_mean"])
    staging_gates.open_all()
    handle.result()

    saved = _load(ckpt.store, 1)["model"]
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(saved[f"1.{name}"], at_cut[name]), name


def test_hook_writing_a_parameter_before_its_fence_is_refused_and_demotes_the_category(
    make_ckpt, staging_gates
) -> None:
    model, opt = _model()
    ckpt = make_ckpt()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    previous = _snapshot(_state(model, opt, step=1))
    ckpt.save(1, _state(model, opt, step=1), modules=[model], optimizers=[opt]).result()

    # A hook that writes a parameter in place during the forward. The automatic proof would demote any hook,
    # so the caller asserts (wrongly) that parameters may wait until the optimizer step.
    def nudge(module: nn.Module, args: Any) -> None:
        module.weight.data.add_(1.0)

    model[0].register_forward_pre_hook(nudge)
    wrong = DeferralProof(
        fences={Category.PARAMETER: Fence.OPTIMIZER_STEP, Category.OPTIMIZER_STATE: Fence.OPTIMIZER_STEP},
        rules=("asserted by the test",),
    )
    staging_gates.before.clear()
    handle = ckpt.save(2, _state(model, opt, step=2), modules=[model], optimizers=[opt], proof=wrong)
    model(_batch())  # the hook writes the weight before the staging copy
    staging_gates.before.set()

    with pytest.raises(TornSnapshotError, match="0.weight"):
        handle.result()
    assert isinstance(handle.staged.exception(), TornSnapshotError)
    assert handle.record.outcome == "torn"
    assert any(e["event"] == "failed" and e.get("outcome") == "torn" for e in ckpt.events.events)
    with pytest.raises(ManifestError):
        ckpt.store.manifest(2)
    assert 2 not in [g.step for g in ckpt.store.generations(include_uncommitted=True)]
    # The previous generation is intact and loads.
    assert ckpt.store.latest().step == 1
    assert ckpt.store.verify(1).ok
    _assert_same(_load(ckpt.store, 1), previous)
    ckpt.poll()  # a refused snapshot is not a storage error: nothing to raise on the training thread

    # The next save copies parameters at the cut, even under the same (wrong) proof.
    handle3 = ckpt.save(3, _state(model, opt, step=3), modules=[model], optimizers=[opt], proof=wrong)
    rows = {row["category"]: row for row in handle3.plan.rows()}
    assert rows["parameter"]["fence"] == "cut"
    assert "demoted" in rows["parameter"]["rule"]
    assert all(s.fence is Fence.CUT for s in handle3.plan.slots if s.category is Category.PARAMETER)
    assert rows["optimizer_state"]["fence"] == "optimizer_step"  # only the torn category is demoted
    assert handle3.result().step == 3


# -- errors: raised once, on the caller thread ------------------------------------------------------------
@pytest.mark.parametrize("surface", ["save", "wait", "poll", "drain"])
def test_upload_failure_surfaces_exactly_once_on_the_caller_thread(make_ckpt, surface: str) -> None:
    serializer = GatedSerializer()
    ckpt = make_ckpt(serializer=serializer, retries=0)
    model, opt = _model()
    ckpt.save(0, _state(model, opt)).result()
    serializer.errors.append(OSError(errno.EIO, "injected I/O error"))  # the next attempt fails
    handle = ckpt.save(1, _state(model, opt))
    assert isinstance(handle.committed.exception(), CheckpointError)

    calls: dict[str, Callable[[], Any]] = {
        "save": lambda: ckpt.save(2, _state(model, opt)),
        "wait": lambda: ckpt.wait(Fence.OPTIMIZER_STEP),
        "poll": ckpt.poll,
        "drain": ckpt.drain,
    }
    with pytest.raises(CheckpointError, match="injected I/O error") as info:
        calls[surface]()
    assert isinstance(info.value.__cause__, OSError)
    result = calls[surface]()  # raised once, then cleared
    if surface == "save":
        result.result()
    ckpt.poll()
    assert serializer.calls == 2 + (surface == "save")  # retries=0: one attempt for the failed save
    assert handle.record.outcome == "failed"
    with pytest.raises(ManifestError):
        ckpt.store.manifest(1)
    _assert_same(_load(ckpt.store, 0)["step"], 0)  # the previous generation still loads
    ckpt.close()  # the error was delivered already: close does not raise it again


def test_a_failed_saves_error_is_pending_before_its_futures_resolve(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False, errors=(OSError(errno.EIO, "injected I/O error"),))
    ckpt = make_ckpt(serializer=serializer, retries=0)
    model, opt = _model()
    handle = ckpt.save(1, _state(model, opt))
    seen: list[BaseException | None] = []
    # Runs on the upload thread the moment the future fails: the error must already be deliverable.
    handle.committed.add_done_callback(lambda _f: seen.append(ckpt.take_pending_error()))
    serializer.gate.set()
    assert handle.committed.exception() is not None
    assert len(seen) == 1 and isinstance(seen[0], CheckpointError)
    assert handle.record in ckpt.records  # the record is final too


def test_transient_upload_error_is_retried_and_then_committed(make_ckpt) -> None:
    serializer = GatedSerializer(errors=(OSError(errno.EIO, "flaky"), ConnectionError("reset")))
    ckpt = make_ckpt(serializer=serializer, retries=2)
    model, opt = _model()
    manifest = ckpt.save(5, _state(model, opt)).result()
    assert manifest.step == 5
    assert serializer.calls == 3
    assert [e["attempt"] for e in ckpt.events.events if e["event"] == "retry"] == [1, 2]
    ckpt.poll()


@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, "no space left"), ValueError("not a storage problem")],
    ids=["enospc", "non_transient"],
)
def test_non_transient_upload_error_is_not_retried(make_ckpt, error: BaseException) -> None:
    serializer = GatedSerializer(errors=(error,))
    ckpt = make_ckpt(serializer=serializer, retries=3)
    model, opt = _model()
    handle = ckpt.save(5, _state(model, opt))
    with pytest.raises(CheckpointError):
        handle.result()
    assert serializer.calls == 1
    with pytest.raises(CheckpointError):
        ckpt.poll()
    assert _committed_steps(ckpt.store) == []


def test_on_error_warn_keeps_training_going(make_ckpt, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = make_ckpt(serializer=GatedSerializer(errors=(OSError(errno.EIO, "injected"),)), retries=0, on_error="warn")
    model, opt = _model()
    handle = ckpt.save(1, _state(model, opt))
    assert handle.committed.exception() is not None
    ckpt.poll()
    ckpt.save(2, _state(model, opt)).result()
    assert "on_error='warn'" in caplog.text


# -- admission --------------------------------------------------------------------------------------------
def test_admission_wait_blocks_until_the_outstanding_save_commits(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer, admission="wait")
    model, opt = _model()
    first = ckpt.save(1, _state(model, opt))

    caller_blocked = threading.Event()
    releaser = threading.Thread(target=lambda: (caller_blocked.wait(), serializer.gate.set()), name="test-releaser")
    releaser.start()
    _call_before_waiting(first.committed, caller_blocked.set)
    second = ckpt.save(2, _state(model, opt))  # blocks until the releaser opens the gate and step 1 commits
    releaser.join()

    assert first.committed.done() and first.result().step == 1
    assert second.decision.decision == "wait"
    assert second.record.decision == "wait"
    assert second.record.admission_wait_s > 0
    assert second.record.blocked_s >= second.record.admission_wait_s
    assert second.decision.backlog == 1
    assert second.result().step == 2
    assert _committed_steps(ckpt.store) == [1, 2]


def test_admission_skip_keeps_the_last_committed_generation(make_ckpt) -> None:
    serializer = GatedSerializer()
    ckpt = make_ckpt(serializer=serializer, admission="skip")
    model, opt = _model()
    ckpt.save(0, _state(model, opt)).result()
    serializer.gate.clear()
    first = ckpt.save(1, _state(model, opt))
    skipped = ckpt.save(2, _state(model, opt))

    assert skipped.decision.decision == "skip"
    assert skipped.record.outcome == "skipped"
    assert skipped.decision.committed_step == 0
    assert all(f.cancelled() for f in (skipped.staged, skipped.uploaded, skipped.committed))
    assert ckpt.skipped == 1
    assert ckpt.outstanding == 1
    serializer.gate.set()
    first.result()
    ckpt.drain()
    assert _committed_steps(ckpt.store) == [0, 1]
    assert ckpt.committed_step == 1


def test_admission_coalesce_takes_the_next_cut_once_drained(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer, admission="coalesce")
    model, opt = _model()
    first = ckpt.save(1, _state(model, opt))
    coalesced = ckpt.save(2, _state(model, opt))

    assert coalesced.decision.decision == "coalesce"
    assert coalesced.record.outcome == "coalesced"
    assert coalesced.committed.cancelled()
    assert ckpt.pending_coalesce == 2
    assert not ckpt.coalesce_due  # the backlog has not drained
    serializer.gate.set()
    first.result()
    ckpt.drain()
    assert ckpt.coalesce_due
    fresh = ckpt.save(3, _state(model, opt))
    assert fresh.decision.decision == "admit"
    assert ckpt.pending_coalesce is None
    assert not ckpt.coalesce_due
    fresh.result()
    assert _committed_steps(ckpt.store) == [1, 3]


def test_admission_abort_raises_records_aborted_and_changes_nothing_else(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer, admission="abort")
    model, opt = _model()
    first = ckpt.save(1, _state(model, opt))

    def observable() -> tuple:
        return (
            ckpt.outstanding,
            ckpt.requested_step,
            ckpt.committed_step,
            ckpt.skipped,
            ckpt.pending_coalesce,
            ckpt.pool.retained_bytes,
        )

    before = observable()
    with pytest.raises(AdmissionError, match="admission='abort'"):
        ckpt.save(2, _state(model, opt))
    assert observable() == before
    # The refused request still ends with a record and a save event saying so.
    aborted = ckpt.records[-1]
    assert (aborted.requested_step, aborted.decision, aborted.outcome) == (2, "abort", "aborted")
    assert aborted.backlog == 1
    saves = [e for e in ckpt.events.events if e["event"] == "save"]
    assert [(e["requested_step"], e["outcome"]) for e in saves] == [(2, "aborted")]
    serializer.gate.set()
    first.result()
    ckpt.drain()
    assert _committed_steps(ckpt.store) == [1]


# -- options and the host-memory budget -------------------------------------------------------------------
def test_host_memory_budget_too_small_is_a_clear_error_naming_needed_and_available_bytes(make_ckpt) -> None:
    ckpt = make_ckpt(host_memory_budget=1_024)
    state = {"weight": torch.zeros(4_096)}  # 16,384 bytes
    with pytest.raises(HostMemoryBudgetError, match=r"needs 16,384 bytes.*allows 1,024") as info:
        ckpt.save(1, state)
    assert "host_memory_budget" in str(info.value)
    assert ckpt.outstanding == 0
    assert ckpt.pool.retained_bytes == 0
    assert ckpt.store.generations(include_uncommitted=True) == []


def test_reserved_host_bytes_count_against_the_budget(make_ckpt) -> None:
    ckpt = make_ckpt(host_memory_budget=20_000, reserved_host_bytes=10_000)
    with pytest.raises(HostMemoryBudgetError, match=r"needs 16,384 bytes.*allows 10,000"):
        ckpt.save(1, {"weight": torch.zeros(4_096)})
    ckpt.save(2, {"weight": torch.zeros(1_024)}).result()


BAD_OPTIONS = [
    ("upload_nice", -1),
    ("upload_nice", 20),
    ("upload_nice", True),
    ("huge_pages", "yes"),
    ("max_outstanding", 0),
    ("max_outstanding", -1),
    ("max_outstanding", True),
    ("max_outstanding", 1.5),
    ("max_outstanding", "1"),
    ("admission", "later"),
    ("admission", None),
    ("host_memory_budget", 0),
    ("host_memory_budget", -5),
    ("host_memory_budget", True),
    ("host_memory_budget", 1.5),
    ("host_memory_budget", "lots"),
    ("reserved_host_bytes", -1),
    ("reserved_host_bytes", True),
    ("reserved_host_bytes", 1.0),
    ("reserved_host_bytes", None),
    ("keep_last", 0),
    ("keep_last", -2),
    ("keep_last", True),
    ("keep_last", "2"),
    ("guard", "no"),
    ("guard", None),
    ("on_error", "ignore"),
    ("on_error", None),
    ("retries", -1),
    ("retries", True),
    ("retries", 1.5),
    ("retries", None),
    ("retry_backoff_s", -0.1),
    ("retry_backoff_s", True),
    ("retry_backoff_s", "1"),
    ("retry_backoff_s", float("nan")),
    ("drain_timeout_s", -1),
    ("drain_timeout_s", None),
    ("drain_timeout_s", float("nan")),
    ("event_log", 5),
    ("event_log", ""),
    ("serializer", object()),
    ("serializer", "torch"),
]


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS, ids=[f"{n}={v!r}" for n, v in BAD_OPTIONS])
def test_invalid_option_is_a_config_error_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        CheckpointOptions(**{name: value})


def test_every_option_field_is_covered_by_the_bad_value_table() -> None:
    import dataclasses

    assert {f.name for f in dataclasses.fields(CheckpointOptions)} == {name for name, _ in BAD_OPTIONS}


def test_invalid_overrides_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admission"):
        AsyncCheckpointer(str(tmp_path / "ckpt"), admission="sometimes")
    with pytest.raises(ConfigError, match="retries"):
        AsyncCheckpointer(str(tmp_path / "ckpt"), CheckpointOptions(), retries=-1)
    with pytest.raises(ConfigError, match="store"):
        AsyncCheckpointer(42)  # type: ignore[arg-type]


# -- lifecycle --------------------------------------------------------------------------------------------
def _library_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def test_close_drains_the_outstanding_save_and_leaks_no_thread(make_ckpt) -> None:
    before = set(_library_threads())
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer)
    model, opt = _model()
    handle = ckpt.save(1, _state(model, opt))
    assert {t.name for t in set(_library_threads()) - before} == {f"{THREAD_PREFIX}-stage", f"{THREAD_PREFIX}-upload"}
    _call_before_waiting(handle.committed, serializer.gate.set)  # released only once close() waits on it
    ckpt.close()
    assert handle.committed.done()
    assert handle.result().step == 1
    assert _committed_steps(ckpt.store) == [1]
    assert set(_library_threads()) - before == set()
    assert ckpt.closed


def test_close_abandon_leaves_no_manifest(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer)
    model, opt = _model()
    handle = ckpt.save(1, _state(model, opt))
    serializer.entered.wait()
    _call_before_waiting(handle.committed, serializer.gate.set)
    before = set(_library_threads()) - {t for t in _library_threads() if t.name.endswith(("-stage", "-upload"))}
    ckpt.close(abandon=True)

    assert isinstance(handle.committed.exception(), CheckpointError)
    assert handle.record.outcome == "abandoned"
    assert ckpt.store.generations(include_uncommitted=True) == []
    with pytest.raises(ManifestError):
        ckpt.store.manifest(1)
    # close joins the abandoned save's threads for a bounded time (1 s); on a busy machine they may still be
    # unwinding then: they must end by themselves, never stay blocked (load-independent).
    for thread in set(_library_threads()) - before:
        thread.join(60)
    assert set(_library_threads()) <= before


def test_close_is_idempotent_and_saving_after_close_fails(make_ckpt) -> None:
    ckpt = make_ckpt()
    model, opt = _model()
    ckpt.save(1, _state(model, opt))
    ckpt.close()
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(2, _state(model, opt))


def test_context_manager_drains_on_exit(tmp_path: Path) -> None:
    model, opt = _model()
    serializer = GatedSerializer(gate_open=False)
    with AsyncCheckpointer(str(tmp_path / "ckpt"), serializer=serializer, host_memory_budget=None) as ckpt:
        handle = ckpt.save(4, _state(model, opt))
        _call_before_waiting(handle.committed, serializer.gate.set)
    assert ckpt.closed
    assert handle.result().step == 4
    assert [g.step for g in CheckpointStore(str(tmp_path / "ckpt")).generations()] == [4]


def test_context_manager_drains_and_keeps_the_body_exception(tmp_path: Path) -> None:
    model, opt = _model()
    ckpt = AsyncCheckpointer(str(tmp_path / "ckpt"), host_memory_budget=None)
    with pytest.raises(KeyError, match="from the body"), ckpt:
        handle = ckpt.save(4, _state(model, opt))
        raise KeyError("from the body")
    assert ckpt.closed
    assert handle.result().step == 4


# -- buffer reuse -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("pace", ["result", "admission_wait"])
def test_fifty_saves_in_a_row_reuse_the_staging_buffers(make_ckpt, pace: str) -> None:
    ckpt = make_ckpt(keep_last=2, host_memory_budget=None)
    model, opt = _model()
    ckpt.attach(model, opt)
    retained, peaks, handles = [], [], []
    for step in range(50):
        _train_step(model, opt)
        handle = ckpt.save(step, _state(model, opt, step), modules=[model], optimizers=[opt])
        handles.append(handle)
        if pace == "result":
            handle.result()
            peaks.append(handle.record.peak_retained_bytes)
        retained.append(ckpt.pool.retained_bytes)
    ckpt.close()  # drains, and retention (which runs after each commit) has finished
    assert all(h.record.outcome == "committed" for h in handles)
    snapshot_bytes = handles[-1].plan.total_bytes
    assert retained == [snapshot_bytes] * 50
    if pace == "result":
        assert peaks == [snapshot_bytes] * 50
    assert max(h.record.peak_retained_bytes for h in handles) == snapshot_bytes
    assert _committed_steps(ckpt.store) == [48, 49]


def test_buffers_are_free_before_the_committed_future_resolves(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer)
    model, opt = _model()
    handle = ckpt.save(1, _state(model, opt))
    in_use: list[int] = []
    handle.committed.add_done_callback(lambda _f: in_use.append(ckpt.pool.in_use_bytes))
    serializer.gate.set()
    handle.result()
    assert in_use == [0]
    assert handle.record.peak_retained_bytes == handle.plan.total_bytes


def test_budget_of_exactly_one_snapshot_suffices_for_back_to_back_saves(make_ckpt) -> None:
    model, opt = _model()
    _train_step(model, opt)
    probe = make_ckpt()
    need = probe.save(0, _state(model, opt)).plan.total_bytes
    probe.close()
    ckpt = make_ckpt(host_memory_budget=need)
    for step in range(1, 11):
        ckpt.save(step, _state(model, opt, step)).result()
    assert ckpt.pool.retained_bytes == need


# -- telemetry --------------------------------------------------------------------------------------------
def test_save_record_fields_are_populated(make_ckpt) -> None:
    ckpt = make_ckpt()
    model, opt = _model()
    ckpt.attach(model, opt)
    _train_step(model, opt)
    handle = ckpt.save(7, _state(model, opt, 7), modules=[model], optimizers=[opt])
    _train_step(model, opt)  # passes both fences
    manifest = handle.result()
    rec = handle.record
    assert rec.requested_step == 7
    assert rec.committed_step == 7
    assert rec.outcome == "committed"
    assert rec.decision == "admit"
    assert rec.blocked_s > 0
    assert rec.staging_s > 0
    assert rec.upload_s > 0
    assert rec.cut_to_committed_s is not None and rec.cut_to_committed_s >= rec.upload_s
    assert rec.bytes == manifest.object(CKPT).size > 0
    assert rec.throughput_bps is not None and rec.throughput_bps > 0
    assert rec.sync_bytes + rec.deferred_bytes == handle.plan.total_bytes
    assert rec.deferred_bytes > 0
    assert rec.peak_retained_bytes == handle.plan.total_bytes
    assert {"cut", "staging", "upload", "commit"} <= set(rec.phases)
    assert rec.error is None
    json.dumps(rec.as_dict())


def test_event_log_is_jsonl_with_an_event_key_per_line(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    model, opt = _model()
    with AsyncCheckpointer(str(tmp_path / "ckpt"), event_log=str(log), host_memory_budget=None) as ckpt:
        ckpt.save(1, _state(model, opt)).result()
        ckpt.save(2, _state(model, opt)).result()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events and all("event" in e and "t" in e for e in events)
    kinds = [e["event"] for e in events]
    assert {"request", "staged", "uploaded", "committed", "save"} <= set(kinds)
    saves = [e for e in events if e["event"] == "save"]
    assert [(e["requested_step"], e["committed_step"], e["outcome"]) for e in saves] == [
        (1, 1, "committed"),
        (2, 2, "committed"),
    ]


# -- the three futures ------------------------------------------------------------------------------------
def test_staged_resolves_before_uploaded_and_committed_and_committed_is_the_manifest(make_ckpt) -> None:
    serializer = GatedSerializer(gate_open=False)
    ckpt = make_ckpt(serializer=serializer)
    model, opt = _model()
    order: list[str] = []
    handle = ckpt.save(3, _state(model, opt))
    for name in ("committed", "uploaded", "staged"):
        getattr(handle, name).add_done_callback(lambda _f, name=name: order.append(name))

    assert handle.staged.result() == 3
    assert not handle.uploaded.done()  # the upload is held at its gate
    assert not handle.committed.done()
    serializer.gate.set()
    manifest = handle.committed.result()
    assert order == ["staged", "uploaded", "committed"]
    assert isinstance(manifest, Manifest)
    assert manifest.step == 3
    assert ckpt.store.manifest(3).objects == manifest.objects
    assert handle.uploaded.result() == manifest.object(CKPT).size == handle.record.bytes
    assert handle.done


def test_reserved_host_bytes_larger_than_the_budget_is_a_clear_error():
    from lightning_async_ckpt.core.engine import CheckpointOptions
    from lightning_async_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="reserved_host_bytes"):
        CheckpointOptions(host_memory_budget=1 << 20, reserved_host_bytes=2 << 20)
