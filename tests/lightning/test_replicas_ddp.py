"""Peer replicas under DDP on CPU: every rank is its own "node" with its own local folder; rank 0's lost folder is
restored from a peer's replica, not from ``dirpath``, and training continues like an uninterrupted run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.tiers.replicas import REPLICA_OF_KEY
from tests.helpers.dist import launch_ranks, rank_results
from tests.helpers.models import assert_same

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "replicas_ddp_worker.py"
pytestmark = pytest.mark.slow


def _launch(base: Path, phase: str, replicas: int, world: int) -> list:
    base.mkdir(parents=True, exist_ok=True)
    return launch_ranks([sys.executable, str(WORKER), str(base), phase, str(replicas)], timeout=300, world_size=world)


def _run(base: Path, phase: str, replicas: int, world: int) -> list[dict]:
    procs = _launch(base, phase, replicas, world)
    results = rank_results(procs)
    return results


def _store(path: Path) -> CheckpointStore:
    return CheckpointStore(str(path), check_writable=False)


def test_a_rank_that_lost_its_local_tier_resumes_from_a_peer_replica(tmp_path):
    _run(tmp_path / "uninterrupted", "uninterrupted", 1, 2)
    run = tmp_path / "run"
    _run(run, "train", 1, 2)
    # Rank 0 wrote steps 2, 4, 6 locally; dirpath got step 4 only; rank 1 (the other node) holds replicas, the newest
    # one always (an older one may be skipped when a newer commit replaced it while a copy was in flight).
    assert [g.step for g in _store(run / "durable").generations()] == [4]
    replicas = _store(run / "local-rank1")
    assert {2, 6} <= {g.step for g in replicas.generations()} <= {2, 4, 6}
    original = _store(run / "local-rank0").manifest(6)
    assert replicas.manifest(6).extra[REPLICA_OF_KEY] == {"rank": 0, "step": 6}
    assert [(o.name, o.size, o.checksum) for o in replicas.manifest(6).objects] == [
        (o.name, o.size, o.checksum) for o in original.objects
    ]

    shutil.rmtree(run / "local-rank0")  # rank 0's node lost its local tier
    r0, r1 = _run(run, "resume", 1, 2)
    # Both ranks resumed from step 6, which dirpath never held: rank 0's copy came from rank 1 over the group. (In
    # this run dirpath's step 4 could not have been read at all: every read of its bytes failed.)
    assert r0["ckpt_path"] == str(run / "local-rank0" / "step-00000006" / "epoch=2-step=6.ckpt")
    assert r1["ckpt_path"] == str(run / "local-rank1" / "step-00000006" / "epoch=2-step=6.ckpt")
    assert _store(run / "local-rank0").manifest(6).extra[REPLICA_OF_KEY] == {"rank": 1, "step": 6}
    assert [g.step for g in _store(run / "durable").generations()] == [4, 8]
    # ... and continued exactly like the run that was never interrupted (rank 0 holds what the checkpoints hold).
    assert_same(torch.load(tmp_path / "uninterrupted" / "final-rank0.pt"), torch.load(run / "final-rank0.pt"), "final")
    uninterrupted = _store(tmp_path / "uninterrupted" / "durable")
    with uninterrupted.open(8, "checkpoint.ckpt") as a, _store(run / "durable").open(8, "checkpoint.ckpt") as b:
        assert_same(torch.load(a)["state_dict"], torch.load(b)["state_dict"], "step8")


def test_the_fault_that_makes_dirpath_unreadable_in_that_test_does_fire(tmp_path):
    from lightning_async_ckpt.testing import Fault

    writer = CheckpointStore(str(tmp_path)).begin(4)
    writer.write_bytes("checkpoint.ckpt", b"x" * 100)
    writer.place("other", "epoch=1-step=4.ckpt")
    writer.write_bytes("other", b"y" * 100)
    writer.commit(cut={})
    options = {"target_protocol": "file", "faults": [Fault(op="read", path="step=4.ckpt", times=None, error="oserror")]}
    store = CheckpointStore(f"faulty://{tmp_path}", options, check_writable=False)
    with pytest.raises(OSError, match="injected"), store.open(4, "other") as f:
        f.read()


def test_more_replicas_than_other_nodes_is_refused_at_setup_on_every_rank(tmp_path):
    procs = _launch(tmp_path, "train", 2, 2)
    for proc in procs:
        assert proc.returncode != 0
        assert "ConfigError: replicas=2 needs 2 other nodes" in proc.stderr, proc.stderr[-2000:]
        assert "pass replicas=N" in proc.stderr


def test_three_nodes_two_replicas_two_lost_folders_restored_from_the_third(tmp_path):
    _run(tmp_path, "train", 2, 3)
    for rank in (1, 2):  # replica i of rank 0 goes to rank i (one rank per node); the newest one always
        assert 6 in {g.step for g in _store(tmp_path / f"local-rank{rank}").generations()}
    shutil.rmtree(tmp_path / "local-rank0")
    shutil.rmtree(tmp_path / "local-rank1")
    results = _run(tmp_path, "resume", 2, 3)
    for rank, r in enumerate(results):
        assert r["ckpt_path"] == str(tmp_path / f"local-rank{rank}" / "step-00000006" / "epoch=2-step=6.ckpt")
    for rank in (0, 1):
        assert _store(tmp_path / f"local-rank{rank}").manifest(6).extra[REPLICA_OF_KEY] == {"rank": 2, "step": 6}
    assert [g.step for g in _store(tmp_path / "durable").generations()] == [4, 8]
