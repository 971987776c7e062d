"""Resume once per job: under a process group rank 0 finds and verifies, every rank gets the same answer.

Two real gloo processes (``tests/helpers/resume_once_worker.py``); every filesystem call of each rank goes through
``faulty://`` and is counted, so "rank 1 reads no manifest" is a count, not a guess.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).parents[1] / "helpers" / "resume_once_worker.py"


def _store(tmp_path: Path, steps: tuple[int, ...] = (2, 4, 6)) -> str:
    root = str(tmp_path / "ckpt")
    store = CheckpointStore(root, run_id="run")
    for step in steps:
        writer = store.begin(step)
        writer.write_bytes("checkpoint.ckpt", f"weights of step {step}".encode() * 100)
        writer.commit()
    return root


MODES = ("latest", "latest_error", "last", "committed", "latest_store")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 2-rank launch running every lookup in turn over one store of steps 2, 4 and 6; each rank's results."""
    root = _store(tmp_path_factory.mktemp("resume-once"))
    results = launch_ranks([sys.executable, str(WORKER), root, *MODES], timeout=240)
    out = []
    for proc in results:
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        out.append(json.loads(line[len("RESULT ") :]))
    return sorted(out, key=lambda r: r["rank"])


@pytest.mark.slow
def test_latest_checkpoint_reads_on_rank_0_only_and_both_ranks_agree(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["latest"] for r in ranks)
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    assert rank0["found"] == rank1["found"]
    assert rank0["found"].endswith("step-00000006/checkpoint.ckpt")
    assert rank0["calls"]["manifest_reads"] == 1  # the newest is intact: one manifest read
    assert rank0["calls"]["ls"] >= 1 and rank0["calls"]["open"] >= 1  # listed, and verified by re-reading
    assert rank1["calls"] == {}  # no listing, no manifest, no object read on rank 1


@pytest.mark.slow
def test_an_error_on_rank_0_is_raised_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["latest_error"] for r in ranks)  # rank 0's listing fails (EIO): no hang, the same error
    assert rank0["error"][0] == rank1["error"][0] == "StoreUnavailableError"
    assert rank0["error"][1] == rank1["error"][1]
    assert rank1["calls"] == {}


@pytest.mark.slow
def test_ckpt_path_last_lists_and_verifies_on_rank_0_and_broadcasts(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["last"] for r in ranks)
    assert "error" not in rank0 and "error" not in rank1, (rank0, rank1)
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["found"] == rank1["found"]
    assert len(rank0["found"]) == 1 and rank0["found"][0].endswith("step-00000006/checkpoint.ckpt")
    assert rank0["calls"]["manifest_reads"] == 1
    assert rank1["calls"].get("manifest_reads", 0) == 0
    assert rank1["calls"].get("ls", 0) == 0 and rank1["calls"].get("open", 0) == 0


@pytest.mark.slow
def test_committed_steps_and_store_latest_once(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["committed"] for r in ranks)
    assert rank0["found"] == rank1["found"] == [2, 4, 6]
    assert rank0["calls"]["manifest_reads"] == 3 and rank1["calls"] == {}
    rank0, rank1 = (r["latest_store"] for r in ranks)
    assert rank0["found"] == rank1["found"] == [6, "run"]
    assert rank0["calls"]["manifest_reads"] == 1 and rank1["calls"] == {}
