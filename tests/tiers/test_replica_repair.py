"""A receiver holding a damaged copy of a replicated generation (its manifest intact) is repaired, write-once: the
held copy's bytes are re-read before "have it", a fresh copy goes to a new version folder, and a restore uses it
(tiers/replica_repair.py, tiers/replica_wire.py, tiers/replica_restore.py). Two real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "replica_repair_worker.py"


@pytest.mark.slow
def test_a_damaged_replica_is_received_again_into_a_new_version_folder_and_a_restore_reads_it_intact(tmp_path):
    results = run_ranks(WORKER, tmp_path, timeout=240)
    r0, r1 = results
    replica = {"rank": 0, "step": 1}
    # The byte flip left the manifest as it was: committed, but it fails verification.
    assert r1["damaged"] == {"0": {"1": [replica, False]}}
    # Re-replicating step 1 sent its bytes again (the held copy was re-read, not only its manifest compared), and
    # the third time the repaired copy was found intact: nothing sent, no further folder.
    assert r0["copied"] == {"1": [1, 1]} and r0["replicated"] == {"1": [1, 1, 1]} and r0["errors"] == []
    # The damaged copy is left as it was (never rewritten); the fresh one is committed in v1, intact.
    assert r1["repaired"] == {"0": {"1": [replica, False]}, "1": {"1": [replica, True]}}
    assert r1["old_byte"] == 0
    # The restore agrees on step 1: rank 1 reads its repaired copy, rank 0 its own (no copy made into its folder).
    assert r0["agreed"] == [0, 1] and r1["agreed"] == [1, 1]
    assert r0["restored_intact"] and r1["restored_intact"]
    assert r0["after_restore"] == {"0": {"1": [None, True]}}
    assert r1["after_restore"] == r1["repaired"]
