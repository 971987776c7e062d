"""Two runs sharing one local tier of sharded (DCP) generations never resume each other's generation (issue 37,
hole 3, for the DCP layout as for the one-stream one): a run resumes the newest generation of its own run lineage,
the one its durable tier names; a run whose durable tier names none of the runs there is refused, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tiers.sharded_resume import latest_across_tiers
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer


def _run(
    local: Path, durable: Path, steps: list[int], offset: float, promote_every: int = 4, resume: bool = True
) -> torch.Tensor:
    """One run (one process, no process group): resume (or start afresh), then save ``steps``; returns what it
    resumed."""
    ckpt = TieredShardedCheckpointer(str(local), str(durable), every_n_train_steps=promote_every)
    try:
        state = {"w": torch.zeros(4)}
        if resume:
            ckpt.resume(state)
        for step in steps:
            ckpt.save(step, {"w": torch.full((4,), offset + step)})
    finally:
        ckpt.close()
    return state["w"]


def test_a_run_resumes_its_own_lineage_from_a_shared_sharded_local_tier(tmp_path: Path) -> None:
    shared = tmp_path / "local"
    _run(shared, tmp_path / "durable-a", [2, 4], offset=0.0)  # run A: local 2, 4; durable-a 4
    _run(shared, tmp_path / "durable-b", [6, 8], offset=100.0, promote_every=8, resume=False)  # B: local 6, 8
    again = TieredShardedCheckpointer(str(shared), str(tmp_path / "durable-a"), every_n_train_steps=4)
    try:
        state = {"w": torch.zeros(4)}
        choice = again.resume(state)
    finally:
        again.close()
    assert choice is not None and choice.step == 4  # A's newest, never B's newer step 8
    assert torch.equal(state["w"], torch.full((4,), 4.0))
    found = latest_across_tiers(str(shared), again.durable)
    assert found is not None and found.step == 4  # the same answer from the function Lightning calls


def test_a_run_whose_durable_tier_names_none_of_the_runs_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "local"
    _run(shared, tmp_path / "durable-a", [2, 4], offset=0.0)
    _run(shared, tmp_path / "durable-b", [6, 8], offset=100.0, promote_every=8, resume=False)
    fresh = TieredShardedCheckpointer(str(shared), str(tmp_path / "durable-c"), every_n_train_steps=4)
    try:
        with pytest.raises(ConfigError, match="local_dirpath"):
            fresh.resume({"w": torch.zeros(4)})
    finally:
        fresh.close()
    kept = sorted(p.name for p in shared.rglob("step-*"))
    assert len(kept) >= 4  # nothing of either run was removed
