"""Accelerate with FSDP2 on 2 gloo CPU ranks: the library's ``save_state`` against accelerate's synchronous one.

accelerate prepares FSDP2 only on accelerator devices; the worker (``tests/helpers/accelerate_fsdp_worker.py``)
forces the state's distributed type to FSDP so that ``accelerator.prepare`` runs accelerate's own FSDP2 path
(``fully_shard``) on gloo CPU ranks, and ``accelerator.save_state``/``load_state`` run accelerate's FSDP2 code.
One save launch (module fixture) serves every test here; the machine is shared, so launches are few.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_async_ckpt.accelerate import attach
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.accelerate_runs import make_run
from tests.helpers.dist import launch_ranks, rank_results

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "accelerate_fsdp_worker.py"


def _launch(mode: str, out: Path, world_size: int = 2) -> tuple[list[dict], list[str]]:
    procs = launch_ranks([sys.executable, str(WORKER), mode, str(out)], timeout=300, world_size=world_size)
    return rank_results(procs), [p.stderr for p in procs]


def _dcp(folder: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/full.pt")
        return torch.load(f"{tmp}/full.pt", weights_only=False)


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_checkpoint(ours: Path, theirs: Path) -> None:
    """Tensor for tensor: the model and optimizer DCP folders, and every small file accelerate wrote in ``theirs``."""
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        _same(_dcp(ours / folder), _dcp(theirs / folder), f"{ours.name}/{folder}")
    small = sorted(f for f in os.listdir(theirs) if f.endswith((".bin", ".pkl")))
    assert small, theirs
    for name in small:
        mine, yours = (torch.load(p / name, weights_only=False) for p in (ours, theirs))
        _same(mine, yours, f"{ours.name}/{name}")


def test_deepspeed_refusal_names_what_works_and_what_to_use_instead(monkeypatch):
    run = make_run()
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.DEEPSPEED))
    with pytest.raises(ConfigError, match="What works today") as info:
        attach(run.acc)
    assert "FullyShardedDataParallelPlugin(fsdp_version=2)" in str(info.value)
    assert "accelerator.save_state without attach()" in str(info.value)


@pytest.mark.parametrize(
    ("version", "state_dict_type", "fix"),
    [(1, "SHARDED_STATE_DICT", "fsdp_version=2"), (2, "FULL_STATE_DICT", "state_dict_type='SHARDED_STATE_DICT'")],
)
def test_fsdp1_and_gathered_state_dicts_are_refused_naming_the_fix(monkeypatch, version, state_dict_type, fix):
    run = make_run()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type)
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.FSDP))
    monkeypatch.setattr(run.acc.state, "fsdp_plugin", plugin, raising=False)
    with pytest.raises(ConfigError, match=re.escape(fix)):
        attach(run.acc, "unused")


@pytest.mark.parametrize("options", [{"admission": "skip"}, {"max_outstanding": 2}])
def test_fsdp2_refuses_admission_it_cannot_honour(monkeypatch, options):
    run = make_run()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.FSDP))
    monkeypatch.setattr(run.acc.state, "fsdp_plugin", plugin, raising=False)
    with pytest.raises(ConfigError, match="every process takes part in every save"):
        attach(run.acc, "unused", **options)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    results, stderr = _launch("save", out)
    return out, results, stderr


@pytest.mark.slow
def test_every_generation_equals_accelerates_synchronous_save_at_the_cut(saved):
    out, results, stderr = saved
    store = CheckpointStore(str(out / "store"), check_writable=False)
    assert [g.step for g in store.generations()] == [3, 5]
    for step in (3, 5):
        gen = out / "store" / f"step-{step:08d}"
        assert_same_checkpoint(gen, out / f"sync-{step}")
        assert store.verify(step).ok
        manifest = store.manifest(step)
        assert manifest.checkpoint_format == "torch_dcp"
        ranks = manifest.extra["ranks"]  # every rank wrote only its own shards; the small files by the coordinator
        assert [n for n in ranks["0"] if n.endswith(".distcp")] == ["__0_0.distcp"]
        assert ranks["1"] == ["__1_0.distcp"]
        assert {"scheduler.bin", "random_states_0.pkl", "random_states_1.pkl", "custom_checkpoint_0.pkl"} <= set(
            ranks["0"]
        )
    for rank in results:
        assert rank["committed_step"] == 5
        assert rank["local_bytes"] < rank["full_bytes"]
        for plan in rank["plans"]:  # weights and Adam moments staged behind the optimizer-step fence
            # Host memory: this rank's shards (and 4 step counters), nothing gathered.
            assert plan["total_bytes"] == rank["local_bytes"] + 4 * 4, plan
            rows = {r["category"]: r for r in plan["rows"]}
            for category in ("parameter", "optimizer_state"):
                assert rows[category]["capture"] == "staged in background", plan
                assert rows[category]["fence"] == "optimizer_step", plan
            assert plan["failures"] == []
    # accelerator.save_state stays accelerate's synchronous save under FSDP2, and says so once per process.
    assert all(err.count("stays synchronous") == 1 for err in stderr)


@pytest.mark.slow
def test_accelerate_loads_the_generation_and_the_library_resume_continues_identically(saved):
    out, saved_results, _ = saved
    results, _ = _launch("resume", out)
    # accelerate's own load_state of the asynchronous generation restores what its own save held.
    assert_same_checkpoint(out / "reloaded-5", out / "sync-5")
    for resumed, original in zip(results, saved_results, strict=True):
        assert resumed["loaded_step"] == 3
        assert resumed["losses"] == original["losses"]  # steps 4 and 5, bit for bit (RNG restored too)
    assert_same_checkpoint(out / "resumed-5", out / "sync-5")
    # The guard on every rank: a write outside the optimizer before the fence refuses step 10, the retake commits.
    for resumed in results:
        assert resumed["torn"] == ["torn", "ShardedSaveError", True, True]
    steps = [g.step for g in CheckpointStore(str(out / "store"), check_writable=False).generations()]
    assert steps == [5, 9, 11]  # keep_last=3 of the resumed run, which continued the saved run (step 3 retired)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 4])
def test_a_generation_of_two_ranks_reshards_onto_one_and_four(saved, world_size):
    out, _, _ = saved
    results, _ = _launch("reshard", out, world_size=world_size)
    assert [r["loaded_step"] for r in results] == [5] * world_size
    resharded = out / f"reshard-{world_size}"
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        _same(_dcp(resharded / folder), _dcp(out / "sync-5" / folder), folder)
    for name in ("scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl"):
        if (resharded / name).exists():
            _same(*(torch.load(p / name, weights_only=False) for p in (resharded, out / "sync-5")), name)
    assert (resharded / "random_states_0.pkl").exists()
    if world_size == 1:  # downloaded from memory:// and loaded: the state at the step-6 cut, one rank
        assert results[0]["from_memory"] == 6
        assert_same_checkpoint(out / "memory-6", resharded)
    assert json.loads((out / "store" / "step-00000005" / "manifest.json").read_text())["cut"]["world_size"] == 2
