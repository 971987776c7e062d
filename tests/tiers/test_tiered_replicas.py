"""Peer replicas for plain loops (issue 25): ``TieredCheckpointer(..., replicas=1)`` under gloo copies rank 0's
local generations to rank 1's own folder; after rank 1's folder is lost, ``restore()`` refills it from rank 0
without reading the durable tier, every rank resumes the same step, and training continues identically; with both
folders lost every rank reads the durable tier's newest generation (chosen by rank 0). Every phase runs in one launch
of the two ranks (``tests/helpers/plain_replicas_worker.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.tiers.replicas import REPLICA_OF_KEY
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "plain_replicas_worker.py"


@pytest.fixture(scope="module")
def phases(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Every phase of the worker in one launch: the base folder and each phase's results (ordered by rank). The
    folders as each phase left them are under ``<base>/after-<phase>``."""
    base = tmp_path_factory.mktemp("plain_replicas")
    results: dict[str, list[dict]] = {}
    for proc in launch_ranks([sys.executable, str(WORKER), str(base)], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                _, phase, body = line.split(" ", 2)
                results.setdefault(phase, []).append(json.loads(body))
    return base, {phase: sorted(rs, key=lambda r: r["rank"]) for phase, rs in results.items()}


def _steps(path: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


@pytest.mark.slow
def test_a_lost_local_folder_is_restored_from_the_peer_and_training_continues_identically(phases) -> None:
    base, results = phases
    trained, after = results["train"], base / "after-train"
    assert [r["rank"] for r in trained] == [0, 1]
    assert _steps(after / "durable") == [4]
    assert 6 in _steps(after / "local-1")  # rank 0's newest generation, replicated into rank 1's own folder
    replica = CheckpointStore(str(after / "local-1"), check_writable=False).manifest(6)
    assert replica.extra[REPLICA_OF_KEY] == {"rank": 0, "step": 6}
    # Rank 1's node lost its local tier between the runs (the worker deleted its folder).
    resumed, after = results["resumed"], base / "after-resumed"
    for r in resumed:
        assert (r["tier"], r["step"]) == ("local", 6), r  # the same step on both ranks, newer than durable's 4
        assert r["durable_reads"] == 0, r  # listed only, never read
    assert resumed[1]["where"].endswith("local-1")
    assert _steps(after / "local-1") == [6]
    assert CheckpointStore(str(after / "local-1"), check_writable=False).verify(6).ok
    assert [r["weights"] for r in resumed] == [trained[0]["weights"]] * 2
    # Both local tiers lost (new nodes): every rank reads the durable tier's newest generation, chosen by rank 0.
    fallen_back = results["fallen_back"]
    assert [(r["tier"], r["step"]) for r in fallen_back] == [("durable", 4)] * 2
    assert [r["weights"] for r in fallen_back] == [trained[0]["weights"]] * 2


@pytest.mark.slow
def test_a_rank_that_only_receives_replicas_is_refused_a_save_with_the_reason(phases) -> None:
    trained = phases[1]["train"]
    assert "only rank 0 saves" in trained[1]["refused"], trained[1]
    assert "refused" not in trained[0]
