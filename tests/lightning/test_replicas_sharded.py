"""``AsyncCheckpointCallback(local_dirpath=..., replicas=1)`` under ``ModelParallelStrategy`` (FSDP2) and DDP with
``ddp_layout="sliced"`` on 2 CPU ranks (gloo), each rank its own node-local folder (the fits are
``tests/helpers/lightning_sharded_replicas_worker.py``'s, in one launch per strategy shared with
``test_tiers_sharded.py``: ``tests/helpers/lightning_sharded_runs.py``): every rank's
local generations are replicated into the other rank's folder; with rank 1's folder lost, ``ckpt_path="last"``
restores rank 1's part from rank 0's replica, every rank loads step 8 from its own local folder (not ``dirpath``),
and training continues exactly like an uninterrupted fit (``mp``; ``sliced`` has dropout, whose random state
Lightning does not restore).
"""

from __future__ import annotations

import pytest

from tests.helpers import lightning_sharded_runs


@pytest.fixture(scope="module", params=["mp", "sliced"])
def ranks(request, tmp_path_factory) -> list[dict]:
    return lightning_sharded_runs.ranks(request.param, "replicas", tmp_path_factory)


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
