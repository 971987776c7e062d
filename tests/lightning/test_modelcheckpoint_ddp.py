"""Issue 15, finding 1 under DDP (2 ranks, gloo): rank 0 decides the top k for every rank, and every rank ends fit
with ModelCheckpoint's attributes (what ``ckpt_path="best"`` reads on that rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "modelcheckpoint_ddp_worker.py"
pytestmark = pytest.mark.slow


def test_top_k_under_ddp_matches_model_checkpoint_on_every_rank(tmp_path):
    procs = launch_ranks([sys.executable, str(WORKER), str(tmp_path)], timeout=180)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.stdout.split("RESULT ", 1)[1].splitlines()[0]) for p in procs]
    for r in results:
        assert r["checkpoint_callback_is_sync"]
        assert r["ours_best_k"] == r["sync_best_k"] and len(r["ours_best_k"]) == 2
        assert r["ours_best"] == r["sync_best"]
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    assert [g.step for g in store.generations()] == results[0]["sync_best_k"]
