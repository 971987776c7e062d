"""``AsyncCheckpointCallback(local_dirpath=..., replicas=1)`` under ``ModelParallelStrategy`` (FSDP2) and DDP with
``ddp_layout="sliced"`` on 2 CPU ranks (gloo), each rank its own node-local folder (``tests/helpers/lightning_sharded_replicas_worker.py``): every rank's
local generations are replicated into the other rank's folder; with rank 1's folder lost, ``ckpt_path="last"``
restores rank 1's part from rank 0's replica, every rank loads step 8 from its own local folder (not ``dirpath``),
and training continues exactly like an uninterrupted fit (``mp``; ``sliced`` has dropout, whose random state
Lightning does not restore).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "lightning_sharded_replicas_worker.py"


@pytest.fixture(scope="module", params=["mp", "sliced"])
def ranks(request, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"replicas_{request.param}")
    procs = launch_ranks([sys.executable, str(WORKER), str(out), request.param], timeout=280)
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line.split(" ", 1)[1]))
    return sorted(results, key=lambda r: r["rank"])


def test_every_rank_local_generations_are_replicated_into_the_peer_folder(ranks):
    for result in ranks:
        assert result["own"] == [6, 8]
        assert 8 in result["replica"], result  # the newest one always (the fit's end drains the replicas)
        assert result["durable"] == [4, 8]


def test_a_lost_folder_is_restored_from_the_peer_and_every_rank_loads_its_own_local_step(ranks):
    for result in ranks:
        assert result["start"] == 8
        rank = result["rank"]
        assert f"lost/node{rank}/rank-{rank}/step-00000008" in result["path"], result  # not dirpath
    assert 8 in ranks[1]["restored_own"]
    if ranks[0]["kind"] == "mp":
        assert ranks[0]["vs_reference_12"] == []  # full weights after resuming equal an uninterrupted fit's
