"""A stalled rank of a failed sharded save never lands in the generation a later attempt committed.

Two real gloo ranks, real DCP, real files (see ``tests/helpers/sharded_zombie_worker.py``): attempt A's rank-1
data write is held by a ``threading.Event`` past A's failure, attempt B commits the same step in the same folder,
then A's write is released. B's generation must still verify and ``dcp.load`` must return B's tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "sharded_zombie_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_a_stalled_rank_of_a_failed_attempt_never_writes_into_the_next_attempts_commit(tmp_path: Path) -> None:
    procs = launch_ranks([sys.executable, str(WORKER), str(tmp_path)], timeout=240)
    results = []
    for proc in procs:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    assert results[1]["a_rank1_claim_live"] == ["live"]  # every rank of an attempt holds its own leased claim
    for result in results:
        assert result["a"] == "ShardedSaveError"  # attempt A failed on both ranks, never committed
        assert result["b"] == 2
        assert result["latest"] == 2 and result["verify_ok"], result
        assert result["loads_b"], result  # dcp.load returns B's tensors, not the stalled write's
