"""Fenced staging of local shards in ShardedCheckpointer: the core plan, proof, guard and buffer pool, per rank."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.errors import TornSnapshotError
from lightning_async_ckpt.sharded import ShardedCheckpointer, ShardedSaveError
from lightning_async_ckpt.sharded.capture import is_fsdp_hook
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.sharded_worker import make_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    return state


def _as_torch(folder: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=True)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_attached_fences_defer_parameters_and_optimizer_state_and_the_generation_is_the_cut(tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        ckpt.attach(model, opt)
        for step in (1, 2):
            at_cut = _snapshot(_state(model, opt))
            handle = ckpt.save(step, _state(model, opt))
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            # Parameters and both Adam moments are deferred; only the scalar step counters are copied at the cut.
            assert handle.deferred_bytes == 3 * weights
            assert handle.sync_bytes == 4 * len(list(model.parameters()))
            _step(model, opt, step)  # the forward/backward run beside the staging; the update waits at the fence
            handle.result(timeout=60)
            assert handle.staged.done()
            _assert_same(_as_torch(tmp_path / f"step-{step:08d}", tmp_path), at_cut)
    assert CheckpointStore(str(tmp_path)).verify(2).ok


def test_buffers_are_reused_by_the_next_save(tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        ckpt.attach(model, opt)
        ckpt.save(1, _state(model, opt)).result(timeout=60)
        first = ckpt.pool.allocations
        _step(model, opt, 1)
        ckpt.save(2, _state(model, opt)).result(timeout=60)
        assert ckpt.pool.allocations == first > 0  # no new buffer for the same shapes


def test_without_fences_everything_is_copied_at_the_cut(tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        handle = ckpt.save(1, _state(model, opt), modules=[model], optimizers=[opt])
        assert handle.deferred_bytes == 0
        handle.staged.result(timeout=60)  # resolved by the staging thread (nothing left to copy)
        handle.result(timeout=60)


def test_a_write_before_the_fence_refuses_the_save_demotes_and_the_next_save_commits(tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    gate = threading.Event()
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        ckpt.attach(model, opt)
        ckpt.save(1, _state(model, opt)).result(timeout=60)
        # Hold the background thread so that the write below lands before step 2's deferred copy starts.
        ckpt.stage_worker.submit(lambda: gate.wait(60))
        handle = ckpt.save(2, _state(model, opt))
        assert handle.deferred_bytes > 0
        with torch.no_grad():
            model[0].weight.add_(1.0)  # not the optimizer: the deferral's proof is broken
        gate.set()
        _step(model, opt, 2)
        # Refused, as by the single-writer engine: the save ends torn, nothing is raised, a retake is due.
        assert ckpt.drain(timeout=60)
        with pytest.raises(ShardedSaveError, match="step 2 failed, not committed") as info:
            handle.result(timeout=0)
        assert info.value.torn
        assert isinstance(info.value.__cause__, TornSnapshotError) or "TornSnapshotError" in str(info.value)
        assert handle.outcome == "torn" and ckpt.retake_due
        assert not (tmp_path / "step-00000002" / MANIFEST_NAME).exists()
        at_cut = _snapshot(_state(model, opt))
        retry = ckpt.save(3, _state(model, opt))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert retry.deferred_bytes == 2 * weights  # parameters are copied at the cut from now on; Adam's moments not
        _step(model, opt, 3)
        retry.result(timeout=60)
    _assert_same(_as_torch(tmp_path / "step-00000003", tmp_path), at_cut)
    assert CheckpointStore(str(tmp_path)).latest().step == 3


def test_fsdp_hooks_are_recognised_and_others_are_not():
    assert not is_fsdp_hook(lambda *a: None)
    assert not is_fsdp_hook(print)


def test_wait_without_a_save_in_flight_returns_at_once(tmp_path):
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        assert ckpt.wait(Fence.OPTIMIZER_STEP) == 0.0


def test_declared_fences_defer_and_wait_releases_them(tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        ckpt.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP}, modules=[model], optimizers=[opt])
        at_cut = _snapshot(_state(model, opt))
        handle = ckpt.save(1, _state(model, opt))
        assert handle.deferred_bytes > 0
        ckpt.wait(Fence.BATCH_START)  # the integration's own hooks call wait at each fence
        model(torch.randn(4, 16)).square().mean().backward()
        ckpt.wait(Fence.OPTIMIZER_STEP)  # every deferred shard landed before the update below
        opt.step()
        handle.result(timeout=60)
    _assert_same(_as_torch(tmp_path / "step-00000001", tmp_path), at_cut)


def test_a_bad_guard_mode_is_a_config_error(tmp_path):
    from lightning_async_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="guard"):
        ShardedCheckpointer(str(tmp_path), guard="sometimes")
