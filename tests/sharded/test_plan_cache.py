"""DCP plan caching in sharded saves: later saves reuse the cached plan, yet each writes under its own attempt.

Bytes of the planning collective before and after are a benchmark (``benchmarks/bench_dcp_planning.py``,
docs/benchmarks.md); here: every save with caching commits, loads back, and writes its own attempt's files (a cached
plan must never carry the first save's token into a later generation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.sharded.plan_cache import plan_caching_available
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.sharded_worker import make_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.skipif(not plan_caching_available(), reason="this torch's DefaultSavePlanner cannot cache plans"),
]


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def test_cached_plans_write_each_save_under_its_own_attempt(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    expected = {}
    with ShardedCheckpointer(str(tmp_path / "store"), plan_caching=True) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(step, _state(model, opt)).result(timeout=60)
    store = CheckpointStore(str(tmp_path / "store"))
    files = {}
    for step in (1, 2, 3):
        assert store.verify(step).ok
        (entry,) = [e for e in store.manifest(step).objects if e.name == "__0_0.distcp"]
        files[step] = entry.key
        out = tmp_path / f"{step}.pt"
        dcp_to_torch_save(str(tmp_path / "store" / f"step-{step:08d}"), str(out))
        loaded = torch.load(out, weights_only=True)["model"]
        assert all(torch.equal(loaded[k], v) for k, v in expected[step].items())
    assert len(set(files.values())) == 3, files  # each save's data file carries its own attempt's token
