"""The core repair of a damaged replica (tiers/replica_repair.py) under the DCP layout: a replica in
``replica-of-rank-<r>`` damaged on disk is received again into ``v1/replica-of-rank-<r>`` when the same step is sent
again, and a rank that lost its own part resumes from it. Two real gloo ranks, raw FSDP2 on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_replica_repair_worker.py"


@pytest.mark.slow
def test_a_damaged_dcp_replica_is_repaired_write_once_and_restores_a_lost_rank(tmp_path):
    results = run_ranks(WORKER, tmp_path, timeout=240)
    r0, r1 = results
    assert r1["damaged"] == {"0": {"1": True, "2": False}}
    # Step 2's bytes went to rank 1 twice: the damaged replica was re-read, not only its manifest compared.
    assert r0["copied"]["2"] == [1, 1]
    # The damaged copy is left as it was; the fresh one is in v1, intact, and is the one held for step 2.
    assert r1["repaired"] == {"0": {"1": True, "2": False}, "1": {"1": False, "2": True}}
    assert r1["held"] == {"0": {"1": 0, "2": 1}}
    # Rank 0 lost its folder: both ranks resume step 2 locally, rank 0's part from rank 1's repaired replica.
    assert [r["step"] for r in results] == [2, 2] and [r["tier"] for r in results] == ["local", "local"]
    assert r0["replica_of"] == {"rank": 1, "step": 2}
    assert r0["resumed_vs_saved"] == [] and r1["resumed_vs_saved"] == []
