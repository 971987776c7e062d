"""Peer replicas of the local tier (tiers/replicas.py) over real gloo processes: where replicas go, a copy that
never commits half, and a restart that restores a lost folder from a peer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_async_ckpt.tiers.replicas import replica_targets
from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "replicas_worker.py"


def test_replicas_land_on_other_nodes_by_the_node_layout():
    # 4 nodes of 2 ranks: the jump is one node, so rank 0's replicas go to local rank 0 of nodes 1 and 2.
    assert replica_targets(0, 8, replicas=2, ranks_per_node=2) == [2, 4]
    assert replica_targets(7, 8, replicas=3, ranks_per_node=2) == [1, 3, 5]
    # One node: the other ranks (each may have its own folder).
    assert replica_targets(0, 3, replicas=2, ranks_per_node=3) == [1, 2]
    with pytest.raises(ValueError, match="at most 1"):
        replica_targets(0, 4, replicas=2, ranks_per_node=2)  # 2 nodes: one other node only
    with pytest.raises(ValueError, match="at most 2"):
        replica_targets(0, 3, replicas=3, ranks_per_node=3)  # not below the world size


@pytest.mark.slow
def test_replicas_commit_whole_or_not_at_all_and_a_lost_folder_is_restored_from_a_peer(tmp_path):
    procs = launch_ranks([sys.executable, str(WORKER), str(tmp_path)], timeout=240, world_size=3)
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT ") :]))
    r0, r1, r2 = results
    # Step 1 reached rank 1's folder (bytes sent once) and rank 2, which shares it, answered "have it".
    assert r0["replicated"]["1"] == [1, 2] and r0["copied"]["1"] == [1]
    assert r1["after_replicas"] == {"1": {"rank": 0, "step": 1}, "3": {"rank": 0, "step": 3}}  # 3: a second round
    # Step 2's source object was damaged: the copy was abandoned on both targets, no manifest, not even a leftover
    # listed; rank 0 got one error per target (raised on its training thread in a fit).
    assert "2" not in r1["after_replicas"] and len(r0["errors"]) == 2
    assert all("checksum" in e for e in r0["errors"])
    # Rank 0 lost its folder: every rank agrees on step 3, and rank 0's copy came from rank 1 (no durable tier here).
    assert [r["agreed_lost_0"] for r in results] == [[0, 3]] * 3
    assert r0["after_restore_0"] == {"3": {"rank": 1, "step": 3}}
    # The folder of ranks 1 and 2 was lost: one copy from rank 0 into it, seen by both.
    assert [r["agreed_lost_1"] for r in results] == [[0, 3]] * 3
    assert r1["after_restore_1"] == r2["after_restore_1"] == {"3": {"rank": 0, "step": 3}}
    # A newer durable step wins for every rank.
    assert [r["agreed_durable_newer"] for r in results] == [None] * 3
    # The shared folder's step 3 was damaged: it gets a fresh copy in a new version folder (v1) beside the damaged
    # one, which is never overwritten; its ranks load v1, rank 0 its own.
    assert [r["agreed_damaged"] for r in results] == [[0, 3], [1, 3], [1, 3]]
    assert r1["damaged_v1"] == {"3": {"rank": 0, "step": 3}}
    # Bounded: while step 10's copy was held, 11 was replaced by 12 (never sent); every source read ran on the
    # replicate thread, and replicate() returned at once each time (the worker would have hung otherwise).
    assert r0["bounded_replicated"] == {"10": [1, 2], "12": [1, 2]}
    assert r0["bounded_readers"] == ["lightning_async_ckpt-replicate"]
    assert {"10", "12"} <= set(r1["bounded"]) and "11" not in r1["bounded"]
