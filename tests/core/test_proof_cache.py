"""The deferral proof is built once while nothing it reads changes, and rebuilt as soon as something does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_async_ckpt.core.capture import Category, Fence, prove_deferral


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_an_unchanged_model_and_optimizer_reuse_the_proof() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = prove_deferral([model], [opt])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # training changes values and optimizer state, not what the proof reads
    assert prove_deferral([model], [opt]) is first


def _forward_hook(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model[0].register_forward_hook(lambda module, args, out: None)


def _param_group_of_an_unowned_parameter(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    # Before: the extra parameter requires grad and no optimizer owns it (demoted); after: owned (proven).
    opt.add_param_group({"params": [model.extra]})


def _step_pre_hook(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: None)


def _gradient_hook(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model[2].bias.register_hook(lambda grad: grad)


def _step_replaced_on_the_instance(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.step = lambda closure=None: None  # type: ignore[method-assign]


def _max_norm_table_added(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.add_module("table", nn.Embedding(10, 2, max_norm=1.0))
    opt.add_param_group({"params": list(model.table.parameters())})


def _unowned_parameter_frozen(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.extra.requires_grad_(False)  # no longer needs an owner


@pytest.mark.parametrize(
    "change",
    [
        _forward_hook,
        _param_group_of_an_unowned_parameter,
        _step_pre_hook,
        _gradient_hook,
        _step_replaced_on_the_instance,
        _max_norm_table_added,
        _unowned_parameter_frozen,
    ],
)
def test_a_change_between_two_cuts_rebuilds_the_proof(change: Callable[[nn.Module, Any], None]) -> None:
    model = _model()
    model.extra = nn.Parameter(torch.zeros(3))
    owned = [p for name, p in model.named_parameters() if name != "extra"]
    opt = torch.optim.SGD(owned, lr=0.1)
    before = prove_deferral([model], [opt])
    assert prove_deferral([model], [opt]) is before
    change(model, opt)
    after = prove_deferral([model], [opt])
    assert after is not before
    assert (after.failures, after.pinned) != (before.failures, before.pinned)


def test_removing_the_hook_again_gives_the_proof_without_it() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    proven = prove_deferral([model], [opt])
    handle = model[0].register_forward_pre_hook(lambda module, args: None)
    hooked = prove_deferral([model], [opt])
    assert hooked.fences[Category.PARAMETER] is Fence.BATCH_START
    handle.remove()
    again = prove_deferral([model], [opt])
    assert again.fences[Category.PARAMETER] is Fence.OPTIMIZER_STEP
    assert again.failures == proven.failures == ()
