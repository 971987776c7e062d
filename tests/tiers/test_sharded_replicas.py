"""Peer replicas of sharded (DCP) local tiers (issue 25 item 3): ``TieredShardedCheckpointer(replicas=1,
ranks_per_node=1)`` on 2 gloo ranks (FSDP2), each rank its own node-local folder (its own "node").

One launch (``tests/helpers/sharded_replicas_worker.py``): a base run saves steps 1-5 (2 and 4 promoted), every
rank's generation replicated into the other rank's folder; then each scenario resumes a copy of the base folders
with one or both folders lost or a copy damaged, and trains on to step 6.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tiers.peer_replicas import replica_where
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_replicas_worker.py"
SCENARIOS = ["lost_one", "lost_both", "damaged_replica", "damaged_own", "other_run"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sharded_replicas")
    procs = launch_ranks([sys.executable, str(WORKER), str(out), ",".join(SCENARIOS)], timeout=300)
    results: dict[str, Any] = {"_stderr": "\n".join(p.stderr[-4000:] for p in procs)}
    for proc in procs:
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                _, name, body = line.split(" ", 2)
                results.setdefault(name, []).append(json.loads(body))
    return results


def _ranks(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = sorted(runs.get(name, []), key=lambda r: r["rank"])
    assert len(got) == 2, f"{name}: {len(got)} rank results\n{runs['_stderr']}"
    for result in got:
        assert "exception" not in result, result["exception"]
    return got


def test_every_rank_generation_is_replicated_into_the_other_rank_folder_apart_from_its_own(runs):
    for result in _ranks(runs, "base"):
        assert result["own_steps"] == [1, 2, 3, 4, 5]
        assert result["replica_steps"] == [1, 2, 3, 4, 5]  # drained after every save: each one replicated
        peer = 1 - result["rank"]
        assert result["replica_extra"]["replica_of"] == {"rank": peer, "step": 5}
        assert result["replica_extra"]["local_tier"] == {"rank": peer, "world_size": 2}


def _continues_identically(result: dict[str, Any]) -> None:
    assert result["resumed_vs_base"] == [], result
    assert result["continued_vs_base_step6"] == [], result
    assert result["promoted_step"] == 6


def test_a_lost_folder_is_restored_from_the_peer_replica_without_reading_durable(runs):
    rank0, rank1 = _ranks(runs, "lost_one")
    for result in (rank0, rank1):
        assert (result["step"], result["tier"]) == (5, "local"), result  # newer than durable's 4
        assert result["durable_reads"] == 0, result  # listed only
        _continues_identically(result)
    assert rank1["where"].endswith("lost_one/node1/rank-1")  # its own store again, not the replica folder
    assert rank1["replica_of"] == {"rank": 0, "step": 5}
    assert rank0["replica_of"] is None  # rank 0 read its own generation


def test_both_folders_lost_every_rank_falls_back_to_durable_together(runs):
    for result in _ranks(runs, "lost_both"):
        assert (result["step"], result["tier"]) == (4, "durable"), result
        _continues_identically(result)


def test_a_damaged_replica_is_not_used_the_newest_intact_one_is(runs):
    rank0, rank1 = _ranks(runs, "damaged_replica")
    for result in (rank0, rank1):
        # Step 5 of rank 1 exists only as rank 0's damaged replica: step 4 (rank 1's part from rank 0's intact
        # replica of it, not older than durable's 4) on both ranks, still without a durable read.
        assert (result["step"], result["tier"]) == (4, "local"), result
        assert result["durable_reads"] == 0, result
        _continues_identically(result)
    assert rank1["replica_of"] == {"rank": 0, "step": 4}


def test_a_damaged_own_part_is_replaced_from_the_peer_into_a_new_version_folder(runs):
    rank0, rank1 = _ranks(runs, "damaged_own")
    for result in (rank0, rank1):
        assert (result["step"], result["tier"]) == (5, "local"), result
        assert result["durable_reads"] == 0, result
        _continues_identically(result)
    assert rank1["where"].endswith("damaged_own/node1/v1/rank-1")  # the damaged committed copy is never rewritten
    assert rank1["replica_of"] == {"rank": 0, "step": 5}
    assert rank0["version"] == rank1["version"] == 1  # every rank writes on in the same version folder


def test_another_run_in_the_same_folders_is_never_resumed_its_own_newest_step_is(runs):
    # Issue 37, hole 3, with peer replicas: the other run's steps 7-8 (own parts and replicas) are newer, but not
    # this run's lineage (the durable tier names this run).
    for result in _ranks(runs, "other_run"):
        assert (result["step"], result["tier"]) == (5, "local"), result
        _continues_identically(result)


@pytest.mark.parametrize(
    ("kwargs", "named"), [({"replicas": 0}, "replicas"), ({"replicas": 1, "ranks_per_node": "2"}, "ranks_per_node")]
)
def test_bad_replica_arguments_are_refused_by_name(tmp_path, kwargs, named):
    with pytest.raises(ConfigError, match=named):
        TieredShardedCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), **kwargs)


def test_more_replicas_than_other_ranks_or_a_remote_local_tier_are_refused_under_a_process_group(runs):
    for result in _ranks(runs, "base"):
        too_many, remote = result["refusals"]
        assert "replicas=2" in too_many and "at most 1" in too_many and "pass replicas=N" in too_many
        assert "node-local folder" in remote and "memory://node" in remote


def test_replicas_without_a_process_group_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="init_process_group"):
        TieredShardedCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), replicas=1)


@pytest.mark.parametrize(
    ("uri", "where"),
    [
        ("/n/local/rank-3", "replica-of-rank-3"),
        ("/n/local/v2/rank-0", "v2/replica-of-rank-0"),
        ("file:///n/local/v1/rank-1/", "v1/replica-of-rank-1"),
    ],
)
def test_a_replica_goes_to_the_same_version_folder_under_a_name_no_rank_reads_as_its_own(uri, where):
    root = "file:///n/local" if uri.startswith("file://") else "/n/local/"
    assert replica_where(root, uri) == where


@pytest.mark.parametrize("where", ["runs", "state"])
def test_a_rank_that_cannot_look_at_its_local_tier_fails_every_rank_instead_of_hanging(tmp_path, where):
    worker = Path(__file__).resolve().parents[1] / "helpers" / "peer_resume_failure_worker.py"
    procs = launch_ranks([sys.executable, str(worker), str(tmp_path), where], timeout=120)
    results = sorted(
        (
            json.loads(line.split(" ", 1)[1])
            for p in procs
            for line in p.stdout.splitlines()
            if line.startswith("RESULT ")
        ),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in results] == [0, 1], "\n".join(p.stderr[-3000:] for p in procs)
    assert results[1]["error"] == "StoreUnavailableError"  # its own error
    assert results[0]["error"] == "RankFailedError"  # told, not left waiting for a collective
