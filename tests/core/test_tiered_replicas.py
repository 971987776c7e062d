"""Peer replicas for plain loops (issue 25): ``TieredCheckpointer(..., replicas=1)`` under gloo copies rank 0's
local generations to rank 1's own folder; after rank 1's folder is lost, ``restore()`` refills it from rank 0
without reading the durable tier, every rank resumes the same step, and training continues identically; with both
folders lost every rank reads the durable tier's newest generation (chosen by rank 0)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.core.replicas import REPLICA_OF_KEY
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "plain_replicas_worker.py"


def _phase(base: Path, phase: str) -> list[dict]:
    results = []
    for proc in launch_ranks([sys.executable, str(WORKER), str(base), phase], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return sorted(results, key=lambda r: r["rank"])


def _steps(path: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


@pytest.mark.slow
def test_a_lost_local_folder_is_restored_from_the_peer_and_training_continues_identically(tmp_path: Path) -> None:
    trained = _phase(tmp_path, "train")
    assert _steps(tmp_path / "durable") == [4]
    assert 6 in _steps(tmp_path / "local-1")  # rank 0's newest generation, replicated into rank 1's own folder
    replica = CheckpointStore(str(tmp_path / "local-1"), check_writable=False).manifest(6)
    assert replica.extra[REPLICA_OF_KEY] == {"rank": 0, "step": 6}
    shutil.rmtree(tmp_path / "local-1")  # rank 1's node lost its local tier between the runs
    resumed = _phase(tmp_path, "resume")
    for r in resumed:
        assert (r["tier"], r["step"]) == ("local", 6), r  # the same step on both ranks, newer than durable's 4
        assert r["durable_reads"] == 0, r  # listed only, never read
    assert resumed[1]["where"].endswith("local-1")
    assert _steps(tmp_path / "local-1") == [6]
    assert CheckpointStore(str(tmp_path / "local-1"), check_writable=False).verify(6).ok
    assert [r["weights"] for r in resumed] == [trained[0]["weights"]] * 2
    # Both local tiers lost (new nodes): every rank reads the durable tier's newest generation, chosen by rank 0.
    shutil.rmtree(tmp_path / "local-0")
    shutil.rmtree(tmp_path / "local-1")
    fallen_back = _phase(tmp_path, "resume")
    assert [(r["tier"], r["step"]) for r in fallen_back] == [("durable", 4)] * 2
    assert [r["weights"] for r in fallen_back] == [trained[0]["weights"]] * 2
