"""Sharded generations in torch DCP's format: ShardedCheckpointer, StoreStorageWriter and the manifest-last commit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_async_ckpt.errors import GenerationExistsError
from lightning_async_ckpt.sharded import DCP_FORMAT, ShardedCheckpointer, ShardedSaveError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.testing import Fault
from tests.helpers.dist import launch_ranks
from tests.helpers.sharded_worker import make_model

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _as_torch(folder: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=True)


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_save_equals_synchronous_dcp_save_and_the_store_verifies_it(tmp_path):
    model, opt = _trained()
    dcp.save(_state(model, opt), checkpoint_id=str(tmp_path / "sync"))
    with ShardedCheckpointer(str(tmp_path / "store")) as ckpt:
        handle = ckpt.save(1, _state(model, opt))
        assert handle.staged.done()
        manifest = handle.result(timeout=60)
        assert [e.name for e in handle.uploaded.result().objects] == ["__0_0.distcp"]
    assert manifest.extra["format"] == DCP_FORMAT and manifest.extra["ranks"] == {"0": ["__0_0.distcp"]}
    assert {e.name for e in manifest.objects} == {".metadata", "__0_0.distcp"}
    gen = tmp_path / "store" / "step-00000001"
    _assert_same(_as_torch(gen, tmp_path), _as_torch(tmp_path / "sync", tmp_path))
    store = CheckpointStore(str(tmp_path / "store"))
    assert store.verify(1).ok
    assert store.latest().step == 1


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_object_store_generations_commit_verify_and_load_with_dcp(backend, request):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if backend == "s3":
        uri, options = request.getfixturevalue("s3_uri")
    else:
        uri, options = request.getfixturevalue("memory_uri"), {}
    model, opt = _trained()
    with ShardedCheckpointer(uri, storage_options=options) as ckpt:
        manifest = ckpt.save(5, _state(model, opt)).result(timeout=60)
    assert {e.name for e in manifest.objects} == {".metadata", "__0_0.distcp"}
    store = CheckpointStore(uri, options)
    assert store.verify(5).ok and store.latest().step == 5
    plain = make_model()
    target = {"model": plain.state_dict()}
    reader = FsspecReader(store.url(5), **options)
    dcp.load(target, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    _assert_same(target["model"], model.state_dict())


def test_the_cut_is_copied_and_buffers_are_reused_across_saves(tmp_path):
    model, opt = _trained()
    at_cut = {k: v.clone() for k, v in model.state_dict().items()}
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        first = ckpt.save(1, _state(model, opt))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after the cut: must not reach generation 1
        first.result(timeout=60)
        ckpt.save(2, _state(model, opt)).result(timeout=60)
    gen1 = _as_torch(tmp_path / "step-00000001", tmp_path)["model"]
    gen2 = _as_torch(tmp_path / "step-00000002", tmp_path)["model"]
    _assert_same(gen1, at_cut)
    _assert_same(gen2, model.state_dict())


def test_storage_failure_commits_nothing_and_raises_once(tmp_path):
    faults = [Fault(op="open", path="__0_0.distcp", at=2, error="enospc")]
    root = f"faulty://{tmp_path}"
    model, opt = _trained()
    with ShardedCheckpointer(root, storage_options={"target_protocol": "file", "faults": faults}) as ckpt:
        ckpt.save(1, _state(model, opt)).result(timeout=60)
        failed = ckpt.save(2, _state(model, opt))
        with pytest.raises(ShardedSaveError, match="step 2 failed, not committed.*No space left"):
            ckpt.drain(timeout=60)
        with pytest.raises(ShardedSaveError):
            failed.result(timeout=0)
        ckpt.drain()  # raised once, then cleared
        assert not (tmp_path / "step-00000002" / MANIFEST_NAME).exists()
        assert CheckpointStore(str(tmp_path)).latest().step == 1
        ckpt.save(3, _state(model, opt)).result(timeout=60)  # the next save commits again
    assert CheckpointStore(str(tmp_path)).latest().step == 3


def test_a_committed_step_is_never_rewritten(tmp_path):
    model, opt = _trained()
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        before = ckpt.save(1, _state(model, opt)).result(timeout=60)
        ckpt.save(1, _state(model, opt))
        with pytest.raises(ShardedSaveError, match="already committed") as info:
            ckpt.drain(timeout=60)
    assert GenerationExistsError.__name__ in str(info.value)
    store = CheckpointStore(str(tmp_path))
    assert store.manifest(1) == before and store.verify(1).ok


def test_keep_last_removes_whole_older_generations_after_each_commit(tmp_path):
    model, opt = _trained()
    with ShardedCheckpointer(str(tmp_path), keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(model, opt)).result(timeout=60)
    store = CheckpointStore(str(tmp_path))
    assert [g.step for g in store.generations(include_uncommitted=True)] == [2, 3]
    assert not (tmp_path / "step-00000001").exists()  # data, DCP metadata and claim: the whole generation
    assert all(store.verify(step).ok for step in (2, 3))


def test_bad_arguments_are_config_errors(tmp_path):
    from lightning_async_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="timeout_s"):
        ShardedCheckpointer(str(tmp_path), timeout_s=0)
    with pytest.raises(ConfigError, match="keep_last"):
        ShardedCheckpointer(str(tmp_path), keep_last=0)
    with ShardedCheckpointer(str(tmp_path)) as ckpt, pytest.raises(ConfigError, match="step"):
        ckpt.save(-1, {})


# -- two processes, raw FSDP2 fully_shard over gloo ---------------------------------------------------------------
def _launch(out: Path, mode: str) -> list[dict[str, Any]]:
    procs: list[subprocess.CompletedProcess] = launch_ranks([sys.executable, str(WORKER), str(out), mode], timeout=90)
    results = []
    for proc in procs:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


@pytest.mark.slow
def test_fsdp2_two_ranks_equal_sync_dcp_save_reshard_to_one_process_and_verify(tmp_path, capsys):
    from lightning_async_ckpt.tools.cli import main

    results = _launch(tmp_path, "ok")
    assert [r["committed"] for r in results] == [[2, 3], [2, 3]]
    assert [r["uploaded"] for r in results] == [["__0_0.distcp"], ["__1_0.distcp"]]
    store = CheckpointStore(str(tmp_path / "store"))
    for step in (2, 3):
        gen = tmp_path / "store" / f"step-{step:08d}"
        ours = _as_torch(gen, tmp_path)
        _assert_same(ours, _as_torch(tmp_path / f"sync-{step}", tmp_path))  # (a) tensor for tensor
        manifest = store.manifest(step)
        assert manifest.extra["ranks"] == {"0": ["__0_0.distcp"], "1": ["__1_0.distcp"]}
        assert manifest.cut["world_size"] == 2
        assert manifest.run_id == results[0]["run_id"] == results[1]["run_id"]  # one run id on every rank
        assert store.verify(step).ok  # (d)
        # The CLI lists both ranks with the bytes each wrote.
        assert main(["ls", str(tmp_path / "store"), "--json"]) == 0
        row = next(r for r in json.loads(capsys.readouterr().out) if r["step"] == step)
        files = {e.name: gen / e.key for e in manifest.objects}  # DCP's names, each file carrying the token
        assert row["ranks"] == {str(r): files[f"__{r}_0.distcp"].stat().st_size for r in (0, 1)}
        # (b) written by 2 ranks, loaded by DCP into a plain module in this single process.
        plain = make_model()
        target = {"model": plain.state_dict()}
        dcp.load(target, checkpoint_id=str(gen), planner=DefaultLoadPlanner(allow_partial_load=True))
        _assert_same(target["model"], ours["model"])
    assert store.latest().step == 3


@pytest.mark.slow
def test_one_rank_storage_failure_no_manifest_both_ranks_raise(tmp_path):
    results = _launch(tmp_path, "fault")
    for r in results:
        assert "step 2 failed, not committed" in r["error"] and "rank 1" in r["error"], r
        assert r["error_after_s"] < 30  # bounded: no rank waits for the group timeout
        assert r["latest_after_failure"] == 1 and r["recovered"]
    assert results[0]["error"] == results[1]["error"]  # the same error on every rank
    assert not (tmp_path / "store" / "step-00000002" / MANIFEST_NAME).exists()
    store = CheckpointStore(str(tmp_path / "store"))
    assert [g.step for g in store.generations()] == [1, 3]
    assert store.verify(1).ok and store.latest().step == 3


@pytest.mark.slow
def test_a_rank_killed_mid_upload_fails_the_save_on_the_survivor_without_a_hang(tmp_path):
    procs = launch_ranks([sys.executable, str(WORKER), str(tmp_path), "kill"], timeout=90)
    assert procs[1].returncode == -9, procs[1].stderr[-3000:]
    lines = [line for line in procs[0].stdout.splitlines() if line.startswith("RESULT ")]
    assert procs[0].returncode == 0 and lines, procs[0].stderr[-3000:]
    survivor = json.loads(lines[-1].removeprefix("RESULT "))
    assert "step 2 failed, not committed" in survivor["error"]
    assert survivor["error_after_s"] < 20  # within the checkpoint group's timeout, far below the default group's
    assert survivor["latest_after_failure"] == 1
    assert not (tmp_path / "store" / "step-00000002" / MANIFEST_NAME).exists()
    store = CheckpointStore(str(tmp_path / "store"))
    assert store.latest().step == 1 and store.verify(1).ok


@pytest.mark.slow
def test_replicated_state_is_written_once_in_slices_by_every_rank(tmp_path):
    results = _launch(tmp_path, "replicated")
    sizes = [r["uploaded"] for r in results]
    assert [list(s) for s in sizes] == [["__0_0.distcp"], ["__1_0.distcp"]]
    assert all(size > 0 for s in sizes for size in s.values())  # every rank wrote a slice
    gen = tmp_path / "store" / "step-00000001"
    sync = tmp_path / "sync-1"
    # DCP's dedup: each replicated item is written by exactly one rank, as a synchronous dcp.save would.
    assert sum(size for s in sizes for size in s.values()) == sum(
        (sync / name).stat().st_size for name in ("__0_0.distcp", "__1_0.distcp")
    )
    ours = _as_torch(gen, tmp_path)
    _assert_same(ours, _as_torch(sync, tmp_path))
    _assert_same(ours["model"], torch.load(tmp_path / "full.pt", weights_only=True))
    assert CheckpointStore(str(tmp_path / "store")).verify(1).ok


@pytest.mark.slow
def test_a_generation_written_by_one_process_loads_into_fsdp2_on_two_ranks(tmp_path):
    model, opt = _trained()
    with ShardedCheckpointer(str(tmp_path / "one")) as ckpt:
        ckpt.save(1, _state(model, opt)).result(timeout=60)
    _launch(tmp_path, "load")
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    _assert_same(loaded, _as_torch(tmp_path / "one" / "step-00000001", tmp_path))
    _assert_same(loaded["model"], model.state_dict())


@pytest.mark.slow
def test_a_slow_rank_blocks_no_training_thread_and_the_save_commits(tmp_path):
    results = _launch(tmp_path, "slow")
    for r in results:
        # Both ranks trained a step while rank 1's write was stalled: no training thread waited for it.
        assert r["committed_while_training"] is False, r
        assert r["committed"] == 1, r  # and the commit came after the slow rank's write
    assert CheckpointStore(str(tmp_path / "store")).verify(1).ok


@pytest.mark.slow
def test_fsdp2_fenced_staging_defers_the_shards_and_equals_sync_dcp_save_at_the_cut(tmp_path):
    results = _launch(tmp_path, "fenced")
    for r in results:
        assert r["committed"] == [2, 3], r
        # Parameters and Adam moments are staged behind the fence; only the step counters are copied at the cut.
        assert all(d > 0 for d in r["deferred"]) and all(
            s < d for s, d in zip(r["sync"], r["deferred"], strict=True)
        ), r
    for step in (2, 3):
        gen = tmp_path / "store" / f"step-{step:08d}"
        _assert_same(_as_torch(gen, tmp_path), _as_torch(tmp_path / f"sync-{step}", tmp_path))
        assert CheckpointStore(str(tmp_path / "store")).verify(step).ok
