"""Issue 15, finding 1, as units: the top-k bookkeeping (requested vs committed views), best-k retention's plan
and its executor on a real local store, and the callback's place beside a ModelCheckpoint."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from lightning_async_ckpt.lightning.selection import after_model_checkpoints
from lightning_async_ckpt.lightning.topk import Entry, TopK
from lightning_async_ckpt.storage.retention import plan_best_k, remove_best_k


def _entry(step: int, score: float | None) -> Entry:
    return Entry(step=step, score=score, filename=f"s{step}.ckpt")


def test_a_generation_counts_as_best_only_once_committed():
    topk = TopK(1, "min")
    topk.requested(_entry(1, 0.5))
    topk.committed(1, "p1")
    topk.requested(_entry(2, 0.4))  # better, still in flight
    assert [e.step for e in topk.best()] == [1]  # the committed view: step 2 is not best yet
    assert not topk.enters(0.45)  # the requested view: 0.45 does not beat the in-flight 0.4
    assert topk.to_remove(keep_newest=1) == []  # nothing is given up before the better one commits
    topk.committed(2, "p2")
    assert [e.step for e in topk.best()] == [2] and topk.to_remove(keep_newest=1) == [1]


def test_a_failed_save_never_counts_and_frees_its_place():
    topk = TopK(1, "max")
    topk.requested(_entry(1, 0.5))
    topk.committed(1, "p1")
    topk.requested(_entry(2, 0.9))
    assert not topk.enters(0.7)
    topk.failed(2)
    assert topk.enters(0.7) and [e.step for e in topk.best()] == [1]


def test_ranking_rules_match_model_checkpoint():
    topk = TopK(2, "min")
    assert not topk.enters(None)  # a missing metric enters nothing
    for step, score in ((1, 0.3), (2, float("nan")), (3, 0.2)):
        assert topk.enters(score) or math.isnan(score)
        topk.requested(_entry(step, score))
        topk.committed(step, f"p{step}")
    assert [e.step for e in topk.best()] == [3, 1]  # NaN ranks last, like ModelCheckpoint's +inf
    assert not topk.enters(0.3)  # a tie with the k-th does not enter (strict comparison)
    assert TopK(-1, "min").enters(99.0) and not TopK(0, "min").enters(0.0)
    # Unranked entries (final or last-only checkpoints) are kept as the newest, never ranked.
    topk.requested(_entry(4, None))
    topk.committed(4, "p4")
    assert [e.step for e in topk.best()] == [3, 1] and topk.to_remove(keep_newest=1) == [2]


def test_plan_best_k_removes_only_this_runs_older_unkept_generations():
    committed = {1: "me", 2: "other", 3: "me", 4: "me", 5: "me"}
    assert plan_best_k(committed, {3, 4}, run_id="me") == (1,)  # 5 is newer than every kept one; 2 is not ours
    assert plan_best_k(committed, {3, 5}, run_id="me", writing=frozenset({4})) == (1,)
    assert plan_best_k(committed, set(), run_id="me") == ()  # nothing kept: nothing removed


def test_remove_best_k_on_a_real_store_rereads_the_manifest(tmp_path):
    mine = CheckpointStore(str(tmp_path), run_id="me")
    other = CheckpointStore(str(tmp_path), run_id="other")
    for store, step in ((mine, 1), (other, 2), (mine, 3)):
        writer = store.begin(step)
        with writer.open("checkpoint.ckpt") as stream:
            stream.write(b"x" * 10)
        writer.commit()
        store.end_write(step)
    assert remove_best_k(mine, [1, 2], keep={3}) == [1]
    assert [g.step for g in mine.generations()] == [2, 3]
    assert remove_best_k(mine, [1], keep={3}) == [1]  # gone already: reported so the caller forgets it


def test_the_callback_moves_only_past_a_model_checkpoint_listed_after_it(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path))
    theirs, plain = ModelCheckpoint(), Callback()
    assert after_model_checkpoints(ours, [ours, plain, theirs]) == [plain, theirs, ours]
    assert after_model_checkpoints(ours, [theirs, ours, plain]) == [theirs, ours, plain]
    assert after_model_checkpoints(ours, [plain, ours]) == [plain, ours]


def test_best_scores_are_float32_tensors_like_model_checkpoints():
    topk = TopK(1, "min")
    topk.requested(_entry(1, float(torch.tensor(0.1234567))))
    topk.committed(1, "p1")
    assert topk.best()[0].score == float(torch.tensor(0.1234567, dtype=torch.float32))
