"""Two-process DDP on CPU (gloo): one writer, collective decisions, failures surface on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "ddp_worker.py"
pytestmark = pytest.mark.slow


def _launch(dirpath: str, mode: str, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    return launch_ranks([sys.executable, str(WORKER), dirpath, mode], timeout=timeout)


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rank produced no result; stderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_only_rank_zero_writes_and_every_rank_takes_the_same_cuts(tmp_path):
    procs = _launch(str(tmp_path), "ok")
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (_result(p) for p in procs)
    assert (r0["writer"], r1["writer"]) == (True, False)
    assert r0["requested"] == r1["requested"] == 8
    assert r0["skipped"] == r1["skipped"] == 0
    assert r0["committed"] == 8
    store = CheckpointStore(str(tmp_path), check_writable=False)
    gens = store.generations(include_uncommitted=True)
    assert [(g.step, g.committed) for g in gens] == [(2, True), (4, True), (6, True), (8, True)]
    for g in gens:
        assert g.manifest.cut["world_size"] == 2
        assert [o.name for o in g.manifest.objects] == ["checkpoint.ckpt"]
        assert store.verify(g.step).ok


def test_a_failure_on_rank_zero_surfaces_on_both_ranks_instead_of_hanging(tmp_path):
    procs = _launch(str(tmp_path), "fail")
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "refuses to be pickled" in procs[0].stderr
    assert "failed on another rank" in procs[1].stderr
    store = CheckpointStore(str(tmp_path), check_writable=False)
    committed = [g.step for g in store.generations()]
    assert committed == [2]  # the failed generation has no manifest; the earlier one is intact
    assert store.verify(2).ok


def test_the_final_checkpoint_between_intervals_is_taken_by_every_rank_at_the_same_batch_end(tmp_path):
    procs = _launch(str(tmp_path), "final")
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (_result(p) for p in procs)
    assert r0["requested"] == r1["requested"] == 7
    assert r0["committed"] == r1["committed"] == 7
    store = CheckpointStore(str(tmp_path), check_writable=False)
    assert [g.step for g in store.generations()] == [2, 4, 6, 7]
    assert store.manifest(7).cut["world_size"] == 2


def test_commit_hooks_run_on_rank_zero_once_per_commit_and_a_raising_one_fails_every_rank(tmp_path):
    # Issue 43: on_commit runs on the writing rank's training thread only; its error is raised on every rank.
    procs = _launch(str(tmp_path / "hooks"), "hooks")
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (_result(p) for p in procs)
    assert r0["told"] == [2, 4, 6, 8] and r1["told"] == []
    procs = _launch(str(tmp_path / "hookfail"), "hookfail")
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "the hook refused" in procs[0].stderr and "failed on another rank" in procs[1].stderr
    assert 2 in [g.step for g in CheckpointStore(str(tmp_path / "hookfail"), check_writable=False).generations()]
