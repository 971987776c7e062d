"""DDP through Lightning with every rank writing a slice (``ddp_layout="sliced"``), against the single-writer layout.

One 2-rank launch (``tests/helpers/lightning_sliced_worker.py``) shared by the slow tests; the rest runs in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_async_ckpt import AsyncCheckpointCallback
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.lightning.sliced import is_dcp_folder, load_lightning_dcp
from lightning_async_ckpt.sharded import DCP_FORMAT
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.dist import launch_ranks
from tests.helpers.models import assert_same

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "lightning_sliced_worker.py"
TORN_WORKER = Path(__file__).resolve().parents[1] / "helpers" / "lightning_torn_worker.py"


def test_a_dcp_folder_loads_into_lightnings_checkpoint_dict_with_integer_parameter_ids(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    dcp.save({"state_dict": model.state_dict(), "optimizer_0": opt.state_dict()}, checkpoint_id=str(tmp_path))
    assert not is_dcp_folder(tmp_path)  # DCP's files alone: no Lightning metadata
    torch.save({"global_step": 1}, tmp_path / "meta.pt")
    assert is_dcp_folder(tmp_path) and not is_dcp_folder(tmp_path / "meta.pt")
    checkpoint = load_lightning_dcp(str(tmp_path))
    assert checkpoint["global_step"] == 1
    assert_same(checkpoint["state_dict"], model.state_dict())
    # DCP flattens the optimizer state's int keys to strings; Optimizer.load_state_dict would drop them silently.
    assert_same(checkpoint["optimizer_states"], [opt.state_dict()])
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(checkpoint["optimizer_states"][0])
    assert torch.equal(fresh.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


def _by_key(obj):
    """``obj`` with every dict's keys in sorted order (lists and tuples keep theirs)."""
    if isinstance(obj, dict):
        return {k: _by_key(obj[k]) for k in sorted(obj, key=str)}
    if isinstance(obj, list | tuple):
        return type(obj)(_by_key(v) for v in obj)
    return obj


def test_an_unknown_ddp_layout_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="ddp_layout must be 'single'.*or 'sliced'"):
        AsyncCheckpointCallback(ddp_layout="striped")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("lightning_sliced")
    procs = launch_ranks([sys.executable, str(WORKER), str(out)], timeout=400)
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return out, sorted(results, key=lambda r: r["rank"])


@pytest.mark.slow
def test_every_rank_writes_a_slice_and_the_result_equals_the_single_writer_checkpoint(run):
    out, _ = run
    sliced = CheckpointStore(str(out / "sliced"), check_writable=False)
    single = CheckpointStore(str(out / "single"), check_writable=False)
    assert [g.step for g in sliced.generations()] == [g.step for g in single.generations()] == [2, 4]
    for step in (2, 4):
        manifest = sliced.manifest(step)
        assert manifest.extra["format"] == DCP_FORMAT and sliced.verify(step).ok
        sizes = {o.name: o.size for o in manifest.objects}
        data = {
            rank: sum(sizes[n] for n in names if n.endswith(".distcp"))
            for rank, names in manifest.extra["ranks"].items()
        }
        # Both ranks wrote part of the replicated state; each item once (DCP's dedup), none twice.
        assert data["0"] > 0 and data["1"] > 0
        expected = torch.load(single.object_url(step, "checkpoint.ckpt"), weights_only=False)
        ours = load_lightning_dcp(sliced.url(step), weights_only=False)
        # BatchNorm buffers are rank 0's, as in the single-writer checkpoint. The order of dict keys differs (DCP
        # lists each rank's items together); Lightning's and torch's loaders match by key.
        assert_same(_by_key(ours.pop("state_dict")), _by_key(expected.pop("state_dict")))
        assert_same(_by_key(ours.pop("optimizer_states")), _by_key(expected.pop("optimizer_states")))
        ours.pop("callbacks"), expected.pop("callbacks")  # each callback's own bookkeeping
        assert_same(ours, expected)


@pytest.mark.slow
def test_ddp_resumes_from_a_sliced_generation_like_from_the_single_writer_one(run):
    out, results = run
    for r in results:
        assert r["sliced_latest"] == str(out / "sliced" / "step-00000004")  # the folder
        assert r["sliced_losses"] == r["single_losses"] and len(r["sliced_losses"]) == 2
    assert_same(
        torch.load(out / "resumed-sliced.pt", weights_only=True),
        torch.load(out / "resumed-single.pt", weights_only=True),
    )


@pytest.mark.slow
def test_a_guard_refusal_on_the_sharded_path_is_retaken_not_raised_and_never_commits_the_write(tmp_path):
    # Before: the sampled guard committed the written row silently, and a refusal (e.g. of a frozen parameter written
    # in training_step) became a ShardedSaveError raised at the next batch end: the fit died on every rank.
    procs = launch_ranks([sys.executable, str(TORN_WORKER), str(tmp_path)], timeout=400)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert "checkpoint for step" in (log := "".join(p.stderr for p in procs)) and "refused" in log  # then retaken
    store = CheckpointStore(str(tmp_path / "sliced"), check_writable=False)
    steps = [g.step for g in store.generations()]
    assert steps and len(steps) < 5, steps  # some cut refused, its retake committed
    for step in steps:
        ours = load_lightning_dcp(store.url(step), weights_only=False)["state_dict"]
        theirs = torch.load(tmp_path / "sync" / f"step={step}.ckpt", weights_only=False)["state_dict"]
        assert_same(_by_key(ours), _by_key(theirs))
