"""Peer replicas for Accelerate's two tiers (issue 25 item 3): ``attach(..., local_dirpath=..., replicas=1,
ranks_per_node=1)`` with two processes on CPU, each its own "node-local" folder. The main process's committed local
generations are copied to process 1's folder; after the main process's folder is lost, ``load_state(...,
local_dirpath=...)`` refills it from process 1's replica without reading ``uri`` and training continues identically;
a damaged replica is skipped; with both folders lost every process loads from ``uri``."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from lightning_async_ckpt.accelerate import attach  # noqa: E402
from lightning_async_ckpt.errors import ConfigError  # noqa: E402
from lightning_async_ckpt.tiers.replicas import REPLICA_OF_KEY  # noqa: E402
from tests.helpers.accelerate_runs import make_run  # noqa: E402
from tests.helpers.dist import launch_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "accelerate_replicas_worker.py"


@pytest.fixture(scope="module")
def phases(tmp_path_factory) -> tuple[Path, dict[str, list[dict]], dict[str, list[str]]]:
    """Every phase of the worker in one launch: the base folder, each phase's results and each process's stderr in
    that phase (both ordered by rank). The folders as each phase left them are under ``<base>/after-<phase>``."""
    base = tmp_path_factory.mktemp("accelerate_replicas")
    results: dict[str, list[dict]] = {}
    stderrs: dict[str, list[str]] = {}
    procs = launch_ranks([sys.executable, str(WORKER), str(base)], timeout=300)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    for proc in sorted(procs, key=lambda p: _rank(p.stdout)):
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                _, phase, body = line.split(" ", 2)
                results.setdefault(phase, []).append(json.loads(body))
        for part in proc.stderr.split("PHASE ")[1:]:
            phase, _, text = part.partition("\n")
            stderrs.setdefault(phase, []).append(text)
    return base, results, stderrs


def _rank(stdout: str) -> int:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.split(" ", 2)[2])["rank"]


def _steps(path: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


@pytest.mark.slow
def test_the_main_process_lost_folder_is_restored_from_the_peer_replica_without_reading_uri(phases) -> None:
    base, results, stderrs = phases
    trained, after = results["train"], base / "after-train"
    assert [r["rank"] for r in trained] == [0, 1]
    assert _steps(after / "durable") == [4]
    assert _steps(after / "local-0") == [2, 4, 6]
    assert 6 in trained[0]["replicated"] and 6 in _steps(after / "local-1")  # the newest one always arrives
    replica = CheckpointStore(str(after / "local-1"), check_writable=False).manifest(6)
    assert replica.extra[REPLICA_OF_KEY] == {"rank": 0, "step": 6}
    weights = trained[0]["weights"]
    assert trained[1]["weights"] == weights

    # The writer's node lost its local tier: both processes resume step 6 (newer than uri's 4) from the local tiers,
    # process 0's refilled from process 1's replica, with no read of uri on either process.
    resumed, after = results["resumed"], base / "after-resumed"
    for r in resumed:
        assert (r["step"], r["promoted"], r["durable_reads"]) == (6, False, 0), r
        assert r["weights"] == weights  # training continued identically
    assert _steps(after / "local-0") == [6]
    assert CheckpointStore(str(after / "local-0"), check_writable=False).verify(6).ok

    # Lost again, and process 1's replica of step 6 is damaged (same size, other bytes): it is not used. Both
    # processes resume step 4 (process 1's replica of it, or uri's when 4 was coalesced away) and train identically.
    damaged, after = results["damaged"], base / "after-damaged"
    assert [r["step"] for r in damaged] == [4, 4]
    assert "skipping local generation" in stderrs["damaged"][1] and "step-00000006" in stderrs["damaged"][1]
    # The resumed run cuts step 6 again: process 1's folder still holds the damaged committed 6 (never overwritten),
    # so every process agreed on a version folder free of it, and the new replica of 6 arrived there intact.
    assert damaged[0]["local_uri"] == str(base / "run" / "local-0" / "v1")
    assert 6 in damaged[0]["replicated"]
    assert CheckpointStore(str(after / "local-1" / "v1"), check_writable=False).verify(6).ok
    expected_reads = 0 if 4 in trained[0]["replicated"] else None
    for r in damaged:
        assert r["weights"] == weights
        if expected_reads is not None:
            assert r["durable_reads"] == expected_reads, r

    # Both nodes lost their local tiers: every process loads uri's step 4 (and reads it), training continues.
    for r in results["fallen_back"]:
        assert (r["step"], r["promoted"]) == (4, True), r
        assert r["durable_reads"] > 0, r  # the counter sees reads of uri: the zero above is not a blind spot
        assert r["weights"] == weights


@pytest.mark.slow
def test_the_default_node_layout_is_accelerates_and_too_many_replicas_are_refused(phases) -> None:
    results = phases[1]["layout"]
    # Both processes on one node (LOCAL_RANK 0 and 1): the replica goes to the other process of that node.
    assert [r["ranks_per_node"] for r in results] == [2, 2]
    assert [(r["targets"], r["sources"]) for r in results] == [([1], []), ([], [0])]
    for r in results:
        assert "replicas=2 needs 2 other ranks" in r["error"] and "pass replicas=N" in r["error"], r


def test_replica_arguments_are_checked_and_a_single_process_makes_none(tmp_path: Path, caplog) -> None:
    run = make_run()
    uri, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with pytest.raises(ConfigError, match="replicas, ranks_per_node need local_dirpath"):
        attach(run.acc, uri, replicas=1, ranks_per_node=1)
    with pytest.raises(ConfigError, match="replicas must be None or an int >= 1"):
        attach(run.acc, uri, local_dirpath=local, replicas=0)
    with pytest.raises(ConfigError, match="ranks_per_node must be None or an int >= 1"):
        attach(run.acc, uri, local_dirpath=local, replicas=1, ranks_per_node=True)
    with pytest.raises(ConfigError, match="ranks_per_node is the node layout of replicas"):
        attach(run.acc, uri, local_dirpath=local, ranks_per_node=1)
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        ckpt = attach(run.acc, uri, local_dirpath=local, replicas=1)
    assert ckpt.replicas is None
    assert "a single process has no peer" in caplog.text
    ckpt.close()
