"""The DCP layout's emergency save waits for its peer replicas within the grace period, as the single-writer layouts
do, and says what was replicated where (tiers/tiered_sharded.py ``emergency_save``). Two real gloo ranks, a real signal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_emergency_replicas_worker.py"


@pytest.mark.slow
def test_a_signal_makes_every_rank_replicate_the_emergency_step_before_the_save_returns(tmp_path):
    results = run_ranks(WORKER, tmp_path, timeout=240)
    for rank, result in enumerate(results):
        target = 1 - rank
        assert result["stopped"] == 3
        # When emergency_save returned (before close), the target had committed this rank's step 3, intact.
        assert result["target_holds"] == [2, 3] and result["target_verified"] == [True, True]
        assert result["replicated"]["3"] == [target]
        assert f"replicated rank {rank}'s step 3 to ranks [{target}]" in result["where"]
        assert "not in time" not in result["where"] and "promoted step 3" in result["where"]


LIGHTNING_WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_emergency_replicas_lightning_worker.py"


@pytest.mark.slow
def test_the_lightning_callback_s_emergency_save_under_fsdp2_waits_for_the_replicas_and_says_where(tmp_path):
    results = run_ranks(LIGHTNING_WORKER, tmp_path, timeout=300)
    for rank, result in enumerate(results):
        target = 1 - rank
        assert result["stopped"] == 5 and result["target_holds"] == [5]
        # The drain's log line is written after the wait: the target had committed the replica by then.
        [line] = result["emergency"]
        assert f"replicated rank {rank}'s step 5 to ranks [{target}]" in line and "not" not in line.split("; rep")[-1]
