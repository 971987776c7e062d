"""The capture plan: classification into categories, storage deduplication, the printable table, and the
deferral proof that decides which categories may be staged after the cut (and demotes them when a rule fails).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence, prove_deferral
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.storage.store import CheckpointStore

PROVEN = DeferralProof(
    fences={
        Category.PARAMETER: Fence.OPTIMIZER_STEP,
        Category.OPTIMIZER_STATE: Fence.OPTIMIZER_STEP,
        Category.BUFFER: Fence.BATCH_START,
    },
    rules=("test rule holds",),
)


# -- helpers ----------------------------------------------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _stepped_adam(model: nn.Module) -> torch.optim.Optimizer:
    """An Adam optimizer with state (moments and its 0-dim ``step``) after one update."""
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()
    return opt


def _categories(plan: CapturePlan) -> dict[str, Category]:
    """Category of every tensor path in the plan."""
    return {name: slot.category for slot in plan.slots for name in slot.names}


def _fences(plan: CapturePlan) -> dict[Category, set[Fence]]:
    out: dict[Category, set[Fence]] = {}
    for slot in plan.slots:
        out.setdefault(slot.category, set()).add(slot.fence)
    return out


def _materialize_copy(plan: CapturePlan) -> Any:
    """Stage every slot synchronously (what the stager does) and rebuild the state from the copies."""
    buffers = []
    for slot in plan.slots:
        src = torch.empty(0, dtype=torch.uint8).set_(slot.storage, 0, (slot.nbytes,), (1,))
        buffers.append(src.clone())
    return plan.materialize(buffers)


# -- classification ---------------------------------------------------------------------------------------
def test_plan_classifies_parameters_optimizer_state_buffers_counters_and_unknown_tensors() -> None:
    model = _model()
    opt = _stepped_adam(model)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "global_step": torch.tensor(7),
        "ema": torch.randn(5),
        "rng_states": {"torch": torch.get_rng_state()},
        "lr_scheduler_last": torch.ones(2),
    }
    plan = CapturePlan.build(state, modules=[model], optimizers=[opt])
    cats = _categories(plan)

    for name in ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"):
        assert cats[f"model.{name}"] is Category.PARAMETER, name
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert cats[f"model.1.{name}"] is Category.BUFFER, name
    for index in opt.state_dict()["state"]:
        assert cats[f"optim.state.{index}.exp_avg"] is Category.OPTIMIZER_STATE
        assert cats[f"optim.state.{index}.exp_avg_sq"] is Category.OPTIMIZER_STATE
        assert cats[f"optim.state.{index}.step"] is Category.COUNTER  # Adam's 0-dim step counter
    assert cats["global_step"] is Category.COUNTER
    assert cats["ema"] is Category.UNKNOWN
    assert cats["rng_states.torch"] is Category.RNG
    assert cats["lr_scheduler_last"] is Category.SCHEDULER


def test_python_objects_are_deep_copied_at_the_cut_and_are_not_staged() -> None:
    hparams = {"lr": 0.1, "layers": [1, 2, 3]}
    plan = CapturePlan.build({"hparams": hparams, "w": torch.ones(3)})
    assert all(not name.startswith("hparams") for slot in plan.slots for name in slot.names)

    hparams["lr"] = 99.0
    hparams["layers"].append(4)  # the next training step mutates the live objects
    rebuilt = _materialize_copy(plan)
    assert rebuilt["hparams"] == {"lr": 0.1, "layers": [1, 2, 3]}


def test_rng_states_and_lists_of_numbers_are_kept_as_they_were_at_the_cut() -> None:
    import random

    random.seed(1)
    python_rng = random.getstate()  # a tuple holding a tuple of 625 ints: kept whole, never visited item by item
    counts = [1, 2, 3]
    plan = CapturePlan.build({"python": python_rng, "mixed": (counts, torch.ones(2))})
    expected = random.random()
    counts.append(4)  # the next training step mutates the live list
    rebuilt = _materialize_copy(plan)
    assert rebuilt["python"] == python_rng
    assert rebuilt["mixed"][0] == [1, 2, 3]
    random.setstate(rebuilt["python"])
    assert random.random() == expected


def test_plan_without_a_proof_copies_everything_at_the_cut() -> None:
    model = _model()
    opt = _stepped_adam(model)
    plan = CapturePlan.build(
        {"model": model.state_dict(), "optim": opt.state_dict()}, modules=[model], optimizers=[opt]
    )
    assert plan.slots
    assert {slot.fence for slot in plan.slots} == {Fence.CUT}
    assert {row["capture"] for row in plan.rows()} == {"copy at cut"}


def test_proven_plan_defers_parameters_and_optimizer_state_to_the_optimizer_step_and_buffers_to_batch_start() -> None:
    model = _model()
    opt = _stepped_adam(model)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "ema": torch.randn(5)}
    plan = CapturePlan.build(state, modules=[model], optimizers=[opt], proof=PROVEN)
    fences = _fences(plan)
    assert fences[Category.PARAMETER] == {Fence.OPTIMIZER_STEP}
    assert fences[Category.OPTIMIZER_STATE] == {Fence.OPTIMIZER_STEP}
    assert fences[Category.BUFFER] == {Fence.BATCH_START}
    assert fences[Category.COUNTER] == {Fence.CUT}
    assert fences[Category.UNKNOWN] == {Fence.CUT}  # unclassified state is never deferred


def test_demoted_category_is_copied_at_the_cut_even_when_proven() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = CapturePlan.build(
        {"model": model.state_dict()}, modules=[model], optimizers=[opt], proof=PROVEN, demoted=[Category.PARAMETER]
    )
    fences = _fences(plan)
    assert fences[Category.PARAMETER] == {Fence.CUT}
    assert fences[Category.BUFFER] == {Fence.BATCH_START}
    rule = {r["category"]: r["rule"] for r in plan.rows()}["parameter"]
    assert "demoted" in rule


# -- storage sharing --------------------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 6, bias=False)
        self.decoder = nn.Linear(6, 6, bias=False)
        self.decoder.weight = self.encoder.weight  # tied: two attributes, one Parameter


def test_tied_weights_and_views_are_staged_once() -> None:
    model = _Tied()
    base = torch.arange(20, dtype=torch.float32)
    state = {"model": model.state_dict(), "base": base, "window": base[4:9], "grid_t": base.view(4, 5).t()}
    plan = CapturePlan.build(state, modules=[model], optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])

    assert len(plan.slots) == 2
    by_name = {name: slot.index for slot in plan.slots for name in slot.names}
    assert by_name["model.encoder.weight"] == by_name["model.decoder.weight"]
    assert by_name["base"] == by_name["window"] == by_name["grid_t"]
    assert plan.total_bytes == 6 * 6 * 4 + 20 * 4
    # The table counts tensors per category but bytes per storage.
    param_row = next(r for r in plan.rows() if r["category"] == "parameter")
    assert param_row["tensors"] == 2
    assert param_row["bytes"] == 6 * 6 * 4


def test_tied_weights_and_views_still_share_storage_after_loading_the_committed_checkpoint(tmp_path: Path) -> None:
    model = _Tied()
    base = torch.arange(20, dtype=torch.float32)
    state = {"model": model.state_dict(), "base": base, "window": base[4:9], "grid_t": base.view(4, 5).t()}
    with AsyncCheckpointer(CheckpointStore(str(tmp_path / "ckpt")), host_memory_budget=None) as ckpt:
        ckpt.save(3, state, modules=[model]).result()
        with ckpt.store.open(3, "checkpoint.ckpt") as f:
            loaded = torch.load(f, weights_only=True)

    enc, dec = loaded["model"]["encoder.weight"], loaded["model"]["decoder.weight"]
    assert torch.equal(enc, model.encoder.weight.detach())
    assert enc.data_ptr() == dec.data_ptr()
    assert enc.untyped_storage().data_ptr() == dec.untyped_storage().data_ptr()

    storage = loaded["base"].untyped_storage().data_ptr()
    assert loaded["window"].untyped_storage().data_ptr() == storage
    assert loaded["grid_t"].untyped_storage().data_ptr() == storage
    assert loaded["window"].storage_offset() == 4
    assert torch.equal(loaded["window"], base[4:9])
    assert torch.equal(loaded["grid_t"], base.view(4, 5).t())
    assert loaded["base"].untyped_storage().nbytes() == 20 * 4  # one copy, not one per view


# -- the printable table ----------------------------------------------------------------------------------
def test_describe_prints_category_tensors_bytes_capture_fence_and_rule() -> None:
    model = _model()
    opt = _stepped_adam(model)
    plan = CapturePlan.build(
        {"model": model.state_dict(), "optim": opt.state_dict()}, modules=[model], optimizers=[opt], proof=PROVEN
    )
    lines = plan.describe().splitlines()
    assert lines[0].split() == ["category", "tensors", "bytes", "capture", "fence", "rule"]
    param_line = next(line for line in lines if line.startswith("parameter "))
    param_bytes = sum(s.nbytes for s in plan.slots if s.category is Category.PARAMETER)
    assert f"{param_bytes:,}" in param_line
    assert "staged in background" in param_line
    assert "optimizer_step" in param_line
    assert "proven: test rule holds" in param_line
    assert any(line.startswith("counter ") and "copy at cut" in line for line in lines)
    assert lines[-1] == f"total {plan.total_bytes:,} bytes in {len(plan.slots)} storages"

    for row in plan.rows():
        assert set(row) == {"category", "tensors", "bytes", "capture", "fence", "rule"}


# -- the deferral proof -----------------------------------------------------------------------------------
def _proof_for(model: nn.Module, opt: Any, **kwargs: Any) -> DeferralProof:
    return prove_deferral([model], [opt], **kwargs)


def test_proof_holds_for_plain_torch_optimizer_with_both_fences() -> None:
    model = _model()
    proof = _proof_for(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert proof.failures == ()
    assert proof.fences[Category.PARAMETER] is Fence.OPTIMIZER_STEP
    assert proof.fences[Category.OPTIMIZER_STATE] is Fence.OPTIMIZER_STEP
    assert proof.fences[Category.BUFFER] is Fence.BATCH_START


class _NotTorchOptimizer:
    def __init__(self, params: Any) -> None:
        self.param_groups = [{"params": list(params)}]
        self.state: dict = {}


class CPUOffloadAdam(torch.optim.Adam):
    """Named like the optimizers that keep their state off the parameters' device."""


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _with_forward_hook(model: nn.Module) -> None:
    model[0].register_forward_hook(lambda mod, args, out: None)


def _with_parametrization(model: nn.Module) -> None:
    torch.nn.utils.parametrize.register_parametrization(model[3], "weight", _Symmetric().requires_grad_(False))


def _frozen_outside_optimizer(model: nn.Module) -> nn.Parameter:
    return model[3].bias


@pytest.mark.parametrize(
    ("case", "expected_failure"),
    [
        ("forward_hook", "hook"),
        ("parametrization", "parametrized"),
        ("param_not_in_optimizer", "no optimizer owns it"),
        ("manual_optimization", "manual optimization"),
        ("non_torch_optimizer", "is not a torch.optim.Optimizer"),
        ("offload_optimizer", "offloads its state"),
        ("no_optimizer_step_fence", "no fence before the optimizer update"),
    ],
)
def test_unproven_rule_demotes_parameters_and_optimizer_state_to_batch_start(case: str, expected_failure: str) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    kwargs: dict[str, Any] = {}
    params = list(model.parameters())
    if case == "forward_hook":
        _with_forward_hook(model)
    elif case == "parametrization":
        _with_parametrization(model)
        params = list(model.parameters())
    elif case == "param_not_in_optimizer":
        left_out = _frozen_outside_optimizer(model)
        params = [p for p in params if p is not left_out]
    elif case == "manual_optimization":
        kwargs["automatic_optimization"] = False
    elif case == "no_optimizer_step_fence":
        kwargs["has_optimizer_step_fence"] = False
    if case == "non_torch_optimizer":
        opt: Any = _NotTorchOptimizer(params)
    elif case == "offload_optimizer":
        opt = CPUOffloadAdam(params)
    else:
        opt = torch.optim.SGD(params, lr=0.1)

    proof = _proof_for(model, opt, **kwargs)
    assert any(expected_failure in failure for failure in proof.failures), proof.failures
    assert proof.fences[Category.PARAMETER] is Fence.BATCH_START
    assert proof.fences[Category.OPTIMIZER_STATE] is Fence.BATCH_START

    plan = CapturePlan.build({"model": model.state_dict()}, modules=[model], optimizers=[opt], proof=proof)
    row = next(r for r in plan.rows() if r["category"] == "parameter")
    assert row["fence"] == "batch_start"
    assert row["rule"].startswith("unproven (") and expected_failure in row["rule"]


def test_unproven_rule_without_a_batch_start_fence_demotes_to_the_cut() -> None:
    model = _model()
    _with_forward_hook(model)
    proof = _proof_for(model, torch.optim.SGD(model.parameters(), lr=0.1), has_batch_start_fence=False)
    assert proof.fences[Category.PARAMETER] is Fence.CUT
    assert proof.fences[Category.OPTIMIZER_STATE] is Fence.CUT
    assert proof.fences[Category.BUFFER] is Fence.CUT


def test_hooks_the_proof_is_told_to_ignore_do_not_demote() -> None:
    model = _model()

    def fence_hook(module: nn.Module, args: Any) -> None:
        return None

    model.register_forward_pre_hook(fence_hook)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _proof_for(model, sgd).failures  # any other hook demotes
    assert _proof_for(model, sgd, ignore_hooks=lambda hook: hook is fence_hook).failures == ()


def test_offload_optimizer_state_is_classified_offloaded_and_copied_at_the_cut() -> None:
    model = _model()
    opt = CPUOffloadAdam(model.parameters(), lr=0.1)
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()
    proof = prove_deferral([model], [opt])
    plan = CapturePlan.build({"optim": opt.state_dict()}, modules=[model], optimizers=[opt], proof=proof)
    moments = [s for s in plan.slots if any(n.endswith(("exp_avg", "exp_avg_sq")) for n in s.names)]
    assert moments
    assert {s.category for s in moments} == {Category.OFFLOADED_OPTIMIZER_STATE}
    assert {s.fence for s in moments} == {Fence.CUT}


def test_optimizer_state_on_another_device_than_its_parameter_is_offloaded_state() -> None:
    # On a CPU-only machine the mismatch is simulated with a meta-device parameter and CPU state.
    param = nn.Parameter(torch.empty(4, device="meta"))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    opt.state[param] = {"momentum_buffer": torch.zeros(4)}
    plan = CapturePlan.build({"optim": opt.state_dict()}, optimizers=[opt], proof=PROVEN)
    (slot,) = plan.slots
    assert slot.category is Category.OFFLOADED_OPTIMIZER_STATE
    assert slot.fence is Fence.CUT


def test_parameters_no_optimizer_owns_are_unknown_and_copied_at_the_cut() -> None:
    # A frozen or hand-updated parameter (an EMA teacher) does not follow the optimizer's mutation rule.
    student, teacher = nn.Linear(4, 4), nn.Linear(4, 4)
    teacher.requires_grad_(False)
    model = nn.ModuleDict({"student": student, "teacher": teacher})
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    plan = CapturePlan.build({"model": model.state_dict()}, modules=[model], optimizers=[opt], proof=PROVEN)
    by_name = {name: slot for slot in plan.slots for name in slot.names}
    assert by_name["model.student.weight"].fence == Fence.OPTIMIZER_STEP
    assert by_name["model.teacher.weight"].category == Category.UNKNOWN
    assert by_name["model.teacher.weight"].fence == Fence.CUT


def test_optimizer_in_backward_and_global_hooks_demote_the_deferral() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert prove_deferral([model], [opt]).fences[Category.PARAMETER] == Fence.OPTIMIZER_STEP

    handle = model.weight.register_post_accumulate_grad_hook(lambda p: None)
    proof = prove_deferral([model], [opt])
    assert proof.fences[Category.PARAMETER] == Fence.BATCH_START
    assert any("post-accumulate-grad" in f for f in proof.failures)
    handle.remove()

    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        proof = prove_deferral([model], [opt])
    finally:
        handle.remove()
    assert proof.fences[Category.PARAMETER] == Fence.BATCH_START
    assert any("global module hook" in f for f in proof.failures)


@pytest.mark.parametrize(
    ("table", "pinned"),
    [
        (nn.Embedding(100, 4, max_norm=1.0), True),
        (nn.EmbeddingBag(100, 4, max_norm=1.0), True),
        (nn.Embedding(100, 4), False),
    ],
)
def test_parameters_a_module_writes_in_forward_are_pinned_to_the_cut(table: nn.Module, pinned: bool) -> None:
    model = nn.Sequential(table, nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    proof = prove_deferral([model], [opt])
    assert proof.failures == ()  # the rest of the proof holds: only the table's weight is pinned
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    plan = CapturePlan.build(state, modules=[model], optimizers=[opt], proof=proof)
    fence_of = {name: slot.fence for slot in plan.slots for name in slot.names}
    assert fence_of["model.0.weight"] is (Fence.CUT if pinned else Fence.OPTIMIZER_STEP)
    assert fence_of["model.1.weight"] is Fence.OPTIMIZER_STEP
    assert fence_of["optim.state.0.exp_avg"] is Fence.OPTIMIZER_STEP  # moments are only written by the step
    rules = [r["rule"] for r in plan.rows() if r["category"] == "parameter" and r["fence"] == "cut"]
    assert bool(rules) is pinned and all("max_norm" in rule for rule in rules)
