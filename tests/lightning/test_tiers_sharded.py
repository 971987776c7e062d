"""``AsyncCheckpointCallback(local_dirpath=...)`` with DCP generations on 2 CPU ranks (gloo): ``ModelParallelStrategy``
(FSDP2) and DDP with ``ddp_layout="sliced"``.

One launch per strategy, shared with ``test_replicas_sharded.py`` (``tests/helpers/lightning_sharded_runs.py``; the fits
are ``tests/helpers/sharded_tiers_lightning_worker.py``'s): each rank has its own node-local folder; a fit writes both tiers; ``ckpt_path="last"`` resumes every rank from its own local folder, and, with rank
1's folder lost, every rank from the durable tier; both continue exactly like an uninterrupted fit (``sliced``: its
dropout's random state is not restored by Lightning, so its two resumed fits are compared with each other).
"""

from __future__ import annotations

import pytest

from tests.helpers import lightning_sharded_runs


@pytest.fixture(scope="module", params=["mp", "sliced"])
def ranks(request, tmp_path_factory) -> list[dict]:
    return lightning_sharded_runs.ranks(request.param, "tiers", tmp_path_factory)


def test_every_cut_lands_in_each_rank_s_own_local_folder_and_the_due_ones_on_dirpath(ranks):
    for result in ranks:
        assert result["first_start"] == 0  # ckpt_path="last" with both tiers empty starts fresh on every rank
        assert result["first_local"] == [6, 8]  # local_keep_last=2 of the cuts every 2 steps
        assert result["first_durable"] == [4, 8]  # every_n_train_steps=4 (8 is also the final one)
        assert result["first_local_meta"] is True  # each rank's folder loads alone: Lightning's meta.pt included


def test_ckpt_path_last_resumes_every_rank_from_its_own_local_folder_and_continues_identically(ranks):
    for result in ranks:
        assert result["local_start"] == 8
        assert f"node{result['rank']}/rank-{result['rank']}/step-00000008" in result["local_path"]
    if ranks[0]["kind"] == "mp":
        assert ranks[0]["local_vs_reference_12"] == []  # full weights after resuming equal an uninterrupted fit's


def test_a_lost_local_folder_on_one_rank_makes_every_rank_resume_from_dirpath_and_continue_identically(ranks):
    for result in ranks:
        assert result["durable_start"] == 8
        assert result["durable_path"].endswith("lost/durable/step-00000008")
        assert result["last_durable"] == [4, 8, 12]
    assert ranks[0]["durable_vs_local_12"] == []  # the durable generation continues exactly like the local one
    if ranks[0]["kind"] == "mp":
        assert ranks[0]["durable_vs_reference_12"] == []


def test_a_signal_on_one_rank_saves_every_rank_to_both_tiers_and_stops_training(ranks):
    stops = {result["emergency_stop"] for result in ranks}
    assert len(stops) == 1 and stops <= {5, 6}  # the next batch end after the signal, the same on every rank
    step = stops.pop()
    for result in ranks:
        assert result["emergency_local"] == [step]
        assert result["emergency_durable"] == [step]
