"""Sharded generations in torch DCP's format: ShardedCheckpointer, StoreStorageWriter and the manifest-last commit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
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
        handle.staged.result(timeout=60)  # no fences passed: everything was copied at the cut
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
# Each test below asserts one scenario (mode) of tests/helpers/sharded_worker.py. The scenarios the selected tests
# need run one after the other in ONE 2-rank launch (a launch is mostly the ranks' imports of torch.distributed and
# this package: ~10 s each on the 2-core machine, ~25 s under load), each from a fresh seeded model in its own
# folder with its own checkpointer and gloo group; a scenario that fails is reported by its own test, and the
# scenarios after it run again in a new launch.
SCENARIOS = ("ok", "fault", "replicated", "load", "slow", "fenced", "kill")  # kill ends the pair: last
#: The whole launch's hang guard (all scenarios: ~15 s quiet, ~30 s at load 5; below pytest's 300 s timeout).
LAUNCH_TIMEOUT_S = 240


def scenario(mode: str):
    """Mark a test as the one asserting ``mode`` of the shared launch."""
    assert mode in SCENARIOS, mode

    def mark(fn):
        fn.sharded_scenario = mode
        return fn

    return mark


@dataclass
class TwoRanks:
    out: Path
    results: dict[str, list[dict[str, Any] | None]]  # mode -> what each rank reported (None: nothing)
    procs: dict[str, list[subprocess.CompletedProcess]]  # mode -> the ranks of the launch it ran in
    hung: set[str]  # the modes of a launch that its hang guard killed
    one_process_model: dict[str, torch.Tensor]  # the state the load scenario's generation was saved from

    def result(self, mode: str, rank: int) -> dict[str, Any]:
        """What ``rank`` reported for ``mode``; fails the test (naming the scenario) when it raised or never ran."""
        r = self.results[mode][rank]
        if r is not None and "exception" not in r:
            return r
        lines = [f"scenario {mode!r} failed"]
        if mode in self.hung:
            lines.append(f"its launch was killed by the {LAUNCH_TIMEOUT_S} s hang guard")
        for i, (got, proc) in enumerate(zip(self.results[mode], self.procs[mode], strict=True)):
            if got is None:
                lines.append(f"rank {i}: did not report (exit status {proc.returncode}):\n{proc.stderr[-3000:]}")
            elif "exception" in got:
                lines.append(f"rank {i} raised:\n{got['exception']}")
            else:
                lines.append(f"rank {i}: passed")
        pytest.fail("\n".join(lines), pytrace=False)

    def ranks(self, mode: str) -> list[dict[str, Any]]:
        return [self.result(mode, rank) for rank in range(len(self.procs[mode]))]


def _failed(mode: str, per_rank: list[dict[str, Any] | None]) -> bool:
    reporting = per_rank[:1] if mode == "kill" else per_rank  # rank 1 dies in kill, on purpose
    return any(r is None or "exception" in r for r in reporting)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> TwoRanks:
    """The scenarios of the selected tests of this module, in ``SCENARIOS`` order, in one 2-rank launch.

    When a scenario fails (the worker stops there), the scenarios after it run again in a new launch, so that each
    test reports its own scenario's outcome; after a hang the rest are not run.
    """
    wanted = {
        getattr(getattr(item, "function", None), "sharded_scenario", None)
        for item in request.session.items
        if item.module is request.module
    }
    pending = [m for m in SCENARIOS if m in wanted]
    out = tmp_path_factory.mktemp("sharded_two_ranks")
    model, opt = _trained()
    if "load" in pending:  # a generation written by this one process, loaded by the two ranks
        with ShardedCheckpointer(str(out / "load" / "one")) as ckpt:
            ckpt.save(1, _state(model, opt)).result(timeout=60)
    ranks = TwoRanks(out, {}, {}, set(), {k: v.clone() for k, v in model.state_dict().items()})
    while pending:
        start = time.monotonic()
        argv = [sys.executable, str(WORKER), str(out), ",".join(pending)]
        procs = launch_ranks(argv, timeout=LAUNCH_TIMEOUT_S, fail_on_hang=False)
        hung = time.monotonic() - start >= LAUNCH_TIMEOUT_S
        for mode in pending:
            ranks.results[mode], ranks.procs[mode] = [None] * len(procs), procs
            if hung:
                ranks.hung.add(mode)
        for rank, proc in enumerate(procs):
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    mode, _, payload = line.removeprefix("RESULT ").partition(" ")
                    ranks.results[mode][rank] = json.loads(payload)
        failed = next((i for i, m in enumerate(pending) if _failed(m, ranks.results[m])), None)
        pending = [] if failed is None or hung else pending[failed + 1 :]
    return ranks


def _not_a_timeout(error: str) -> bool:
    return "timed out" not in error.lower() and "timeout" not in error.lower()


@pytest.mark.slow
@scenario("ok")
def test_fsdp2_two_ranks_equal_sync_dcp_save_reshard_to_one_process_and_verify(two_ranks, tmp_path, capsys):
    from lightning_async_ckpt.tools.cli import main

    results = two_ranks.ranks("ok")
    out = two_ranks.out / "ok"
    assert [r["committed"] for r in results] == [[2, 3], [2, 3]]
    assert [r["uploaded"] for r in results] == [["__0_0.distcp"], ["__1_0.distcp"]]
    store = CheckpointStore(str(out / "store"))
    for step in (2, 3):
        gen = out / "store" / f"step-{step:08d}"
        ours = _as_torch(gen, tmp_path)
        _assert_same(ours, _as_torch(out / f"sync-{step}", tmp_path))  # (a) tensor for tensor
        manifest = store.manifest(step)
        assert manifest.extra["ranks"] == {"0": ["__0_0.distcp"], "1": ["__1_0.distcp"]}
        assert manifest.cut["world_size"] == 2
        assert manifest.run_id == results[0]["run_id"] == results[1]["run_id"]  # one run id on every rank
        assert store.verify(step).ok  # (d)
        # The CLI lists both ranks with the bytes each wrote.
        assert main(["ls", str(out / "store"), "--json"]) == 0
        row = next(r for r in json.loads(capsys.readouterr().out) if r["step"] == step)
        files = {e.name: gen / e.key for e in manifest.objects}  # DCP's names, each file carrying the token
        assert row["ranks"] == {str(r): files[f"__{r}_0.distcp"].stat().st_size for r in (0, 1)}
        # (b) written by 2 ranks, loaded by DCP into a plain module in this single process.
        plain = make_model()
        target = {"model": plain.state_dict()}
        dcp.load(target, checkpoint_id=str(gen), planner=DefaultLoadPlanner(allow_partial_load=True))
        _assert_same(target["model"], ours["model"])
    assert store.latest().step == 3
    # Issue 43: the run's final generation, written by 2 ranks, exported to safetensors and loaded with it alone.
    from safetensors.torch import load_file

    from lightning_async_ckpt.core.export import SINGLE_NAME, export_safetensors

    exported = export_safetensors(store, 3, str(tmp_path / "export"))
    weights = load_file(str(tmp_path / "export" / "step-00000003" / exported.object(SINGLE_NAME).key))
    _assert_same(weights, ours["model"], "export")


@pytest.mark.slow
@scenario("fault")
def test_one_rank_storage_failure_no_manifest_both_ranks_raise(two_ranks):
    results = two_ranks.ranks("fault")
    out = two_ranks.out / "fault"
    for r in results:
        assert "step 2 failed, not committed" in r["error"] and "rank 1" in r["error"], r
        # Bounded: the error is rank 1's injected one, reported to both ranks without waiting for the group
        # timeout (a property of the error, not of how busy the machine is; it comes in well under a second).
        assert "injected I/O error" in r["error"] and _not_a_timeout(r["error"]), r
        assert r["error_after_s"] < r["group_timeout_s"], r
        assert r["latest_after_failure"] == 1 and r["recovered"]
    assert results[0]["error"] == results[1]["error"]  # the same error on every rank
    assert not (out / "store" / "step-00000002" / MANIFEST_NAME).exists()
    store = CheckpointStore(str(out / "store"))
    assert [g.step for g in store.generations()] == [1, 3]
    assert store.verify(1).ok and store.latest().step == 3


@pytest.mark.slow
@scenario("kill")
def test_a_rank_killed_mid_upload_fails_the_save_on_the_survivor_without_a_hang(two_ranks):
    out = two_ranks.out / "kill"
    survivor = two_ranks.result("kill", 0)
    assert two_ranks.procs["kill"][1].returncode == -9, two_ranks.procs["kill"][1].stderr[-3000:]
    assert two_ranks.results["kill"][1] is None  # rank 1 died before it could report
    assert "step 2 failed, not committed" in survivor["error"]
    # From the broken connection to the dead peer, not from a timeout: within the checkpoint group's timeout,
    # far below the default group's (a property of the error, whatever the machine's load).
    assert _not_a_timeout(survivor["error"]), survivor
    assert survivor["error_after_s"] < survivor["group_timeout_s"], survivor
    assert survivor["latest_after_failure"] == 1
    assert not (out / "store" / "step-00000002" / MANIFEST_NAME).exists()
    store = CheckpointStore(str(out / "store"))
    assert store.latest().step == 1 and store.verify(1).ok


@pytest.mark.slow
@scenario("replicated")
def test_replicated_state_is_written_once_in_slices_by_every_rank(two_ranks, tmp_path):
    results = two_ranks.ranks("replicated")
    out = two_ranks.out / "replicated"
    sizes = [r["uploaded"] for r in results]
    assert [list(s) for s in sizes] == [["__0_0.distcp"], ["__1_0.distcp"]]
    assert all(size > 0 for s in sizes for size in s.values())  # every rank wrote a slice
    gen = out / "store" / "step-00000001"
    sync = out / "sync-1"
    # DCP's dedup: each replicated item is written by exactly one rank, as a synchronous dcp.save would.
    assert sum(size for s in sizes for size in s.values()) == sum(
        (sync / name).stat().st_size for name in ("__0_0.distcp", "__1_0.distcp")
    )
    ours = _as_torch(gen, tmp_path)
    _assert_same(ours, _as_torch(sync, tmp_path))
    _assert_same(ours["model"], torch.load(out / "full.pt", weights_only=True))
    assert CheckpointStore(str(out / "store")).verify(1).ok


@pytest.mark.slow
@scenario("load")
def test_a_generation_written_by_one_process_loads_into_fsdp2_on_two_ranks(two_ranks, tmp_path):
    two_ranks.ranks("load")
    out = two_ranks.out / "load"
    loaded = torch.load(out / "loaded.pt", weights_only=True)
    _assert_same(loaded, _as_torch(out / "one" / "step-00000001", tmp_path))
    _assert_same(loaded["model"], two_ranks.one_process_model)


@pytest.mark.slow
@scenario("slow")
def test_a_slow_rank_blocks_no_training_thread_and_the_save_commits(two_ranks):
    results = two_ranks.ranks("slow")
    for r in results:
        # Both ranks trained a step while rank 1's write was stalled: no training thread waited for it.
        assert r["committed_while_training"] is False, r
        assert r["committed"] == 1, r  # and the commit came after the slow rank's write
    assert CheckpointStore(str(two_ranks.out / "slow" / "store")).verify(1).ok


@pytest.mark.slow
@scenario("fenced")
def test_fsdp2_fenced_staging_defers_the_shards_and_equals_sync_dcp_save_at_the_cut(two_ranks, tmp_path):
    results = two_ranks.ranks("fenced")
    out = two_ranks.out / "fenced"
    for r in results:
        assert r["committed"] == [2, 3], r
        # Parameters and Adam moments are staged behind the fence; only the step counters are copied at the cut.
        assert all(d > 0 for d in r["deferred"]) and all(
            s < d for s, d in zip(r["sync"], r["deferred"], strict=True)
        ), r
    for step in (2, 3):
        gen = out / "store" / f"step-{step:08d}"
        _assert_same(_as_torch(gen, tmp_path), _as_torch(out / f"sync-{step}", tmp_path))
        assert CheckpointStore(str(out / "store")).verify(step).ok
