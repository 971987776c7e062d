"""Two tiers for sharded (DCP) generations in plain loops: ``TieredShardedCheckpointer`` on 2 gloo ranks (FSDP2).

Every scenario runs in one 2-rank launch (``tests/helpers/sharded_tiers_worker.py``), the kill's restart in a second
one; each test asserts its scenario's per-rank results. Layouts: ``node`` (each rank its own node-local folder, as
on two nodes) and ``shared`` (both ranks one folder).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.testing import Fault
from lightning_async_ckpt.tiers.sharded_resume import TierChoice
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_tiers_worker.py"
FIRST = ["equiv:node", "equiv:shared", "deleted:node", "damaged:node", "behind:shared", "emergency:node", "kill:node"]
LAUNCH_TIMEOUT_S = 240


def _results(procs: list[Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for proc in procs:
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                _, mode, body = line.split(" ", 2)
                out.setdefault(mode, []).append(json.loads(body))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sharded_tiers")
    first = launch_ranks([sys.executable, str(WORKER), str(out), ",".join(FIRST)], timeout=LAUNCH_TIMEOUT_S)
    second = launch_ranks([sys.executable, str(WORKER), str(out), "kill_resume:node"], timeout=LAUNCH_TIMEOUT_S)
    results = _results(first) | _results(second)
    results["_stderr"] = "\n".join(p.stderr[-3000:] for p in (*first, *second))
    return results


def _ranks(runs: dict[str, Any], mode: str, expected: int = 2) -> list[dict[str, Any]]:
    got = sorted(runs.get(mode, []), key=lambda r: r["rank"])
    assert len(got) == expected, f"{mode}: {len(got)} rank results\n{runs['_stderr']}"
    for result in got:
        assert "exception" not in result, result["exception"]
    return got


@pytest.mark.parametrize("layout", ["node", "shared"])
def test_the_promoted_durable_generation_equals_the_local_one_tensor_for_tensor(runs, layout):
    for result in _ranks(runs, f"equiv:{layout}"):
        assert result["resumed"] is False
        assert result["promoted_step"] == 6
        assert result["durable_steps"] == [2, 4, 6]
        assert result["local_vs_durable"] == [] and result["tensors_compared"] >= 10
        assert result["local_vs_step4_weights"] == [] and result["durable_vs_step4_weights"] == []
        # Each rank's local generation holds only its own files (a node-local folder is read by its node only),
        # the replicated tensor included; the durable one every rank's.
        own = [".metadata", f"__{result['rank']}_0.distcp"] + (["global.metadata"] if result["rank"] == 0 else [])
        assert result["local_names"] == sorted(own)
        assert result["extra_local"] == [4.0, 5.0, 6.0, 7.0]
        assert result["durable_ranks"] == ["0", "1"]


@pytest.mark.parametrize("mode", ["deleted:node", "damaged:node", "behind:shared"])
def test_a_rank_without_its_local_part_makes_every_rank_resume_from_durable_and_continue_identically(runs, mode):
    for result in _ranks(runs, mode):
        assert (result["step"], result["tier"]) == (4, "durable")
        assert result["resumed_vs_base"] == []
        assert result["continued_vs_base_step6"] == []
        assert result["version"] == 1  # the local tier held step 5 (on rank 0): a new version folder, never rewritten
        assert result["promoted_step"] == 6
        assert result["durable_steps"] == [2, 4, 6]


def test_a_rank_killed_during_a_promotion_leaves_no_committed_durable_step_and_the_restart_resumes(runs):
    killed = sorted(runs.get("kill:node", []), key=lambda r: r["rank"])
    assert [r["rank"] for r in killed] == [0], runs["_stderr"]
    survivor = killed[0]
    assert survivor["error"] is not None and survivor["error"].startswith("PromotionError"), survivor
    assert survivor["durable"] == {"2": False}  # the half-promoted step is there, uncommitted: never listed
    assert survivor["local_steps"] == [1, 2]
    for result in _ranks(runs, "kill_resume:node"):
        assert (result["step"], result["tier"]) == (2, "local")
        assert result["promoted_step"] == 4
        assert result["durable_committed"] == [4] and result["durable_verified"] is True


def test_a_signal_on_one_rank_makes_every_rank_save_that_step_to_both_tiers(runs):
    for result in _ranks(runs, "emergency:node"):
        assert result["stopped"] == 3
        assert result["local_steps"] == [2, 3] and result["durable_steps"] == [3]
        assert "committed step 3" in result["where"] and "promoted step 3" in result["where"]


def test_bad_arguments_name_the_parameter(tmp_path):
    for kwargs, name in (
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"local_keep_last": True}, "local_keep_last"),
        ({"keep_last": -1}, "keep_last"),
    ):
        with pytest.raises(ConfigError, match=name):
            TieredShardedCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), **kwargs)
    with pytest.raises(ConfigError, match="local_dirpath"):
        TieredShardedCheckpointer("", str(tmp_path / "durable"))
    with pytest.raises(ConfigError, match="preemption_signal"):
        TieredShardedCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), preemption_signal=12345)


def test_one_process_saves_promotes_and_resumes_from_the_newest_tier(tmp_path):
    model = torch.nn.Linear(4, 4)
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    with TieredShardedCheckpointer(local, durable, every_n_train_steps=2, local_keep_last=1) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step, {"model": model.state_dict()})
        ckpt.drain()
        assert ckpt.promoted_step == 2
    assert [g.step for g in CheckpointStore(durable, check_writable=False).generations()] == [2]
    fresh = {"model": torch.nn.Linear(4, 4).state_dict()}
    with TieredShardedCheckpointer(local, durable) as again:
        choice = again.resume(fresh)
    assert choice is not None and (choice.step, choice.tier) == (3, "local")
    assert torch.equal(fresh["model"]["weight"], model.weight.detach())


def test_a_stalled_promoter_that_wakes_after_another_committed_the_step_never_touches_it(tmp_path):
    reached, release = threading.Event(), threading.Event()
    stall = Fault(op="write", path="step-00000002/__0_0.distcp", stall=release, callback=lambda call: reached.set())
    durable_url = str(tmp_path / "durable")
    stalled_durable = CheckpointStore(
        f"faulty://{durable_url}", {"target_protocol": "file", "faults": [stall]}, check_writable=False
    )
    zombie = TieredShardedCheckpointer(str(tmp_path / "a"), stalled_durable, every_n_train_steps=2)
    zombie.save(2, {"w": torch.zeros(4)})
    assert reached.wait(60)  # its promotion claimed step 2 and stalls in its first durable write
    with TieredShardedCheckpointer(str(tmp_path / "b"), durable_url, every_n_train_steps=2) as winner:
        winner.save(2, {"w": torch.ones(4)})
        winner.drain()
        assert winner.promoted_step == 2
    release.set()
    zombie.drain()
    zombie.close()
    durable = CheckpointStore(durable_url, check_writable=False)
    assert [g.step for g in durable.generations()] == [2]
    assert durable.verify(2).ok
    assert durable.manifest(2).extra["promoted_from"]["uri"].endswith("b/rank-0")
    state = {"w": torch.zeros(4)}
    TierChoice(2, "durable", durable).load(state)
    assert torch.equal(state["w"], torch.ones(4))
    assert zombie.promoted_step is None


def test_commit_callbacks_hear_each_local_commit_and_each_promotion(tmp_path):
    # Issue 43: the promotion of a sharded generation is its own commit event (tier="durable").
    seen = []
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    with TieredShardedCheckpointer(local, durable, every_n_train_steps=2) as ckpt:
        ckpt.add_commit_callback(seen.append)
        for step in (1, 2):
            ckpt.save(step, {"model": torch.nn.Linear(4, 4).state_dict()})
        ckpt.drain()
    assert sorted((c.step, c.tier) for c in seen) == [(1, "local"), (2, "durable"), (2, "local")]
    promoted = next(c for c in seen if c.tier == "durable")
    assert promoted.uri == CheckpointStore(durable, check_writable=False).url(2)
    assert promoted.manifest.format == "torch_dcp" and promoted.path == promoted.uri
