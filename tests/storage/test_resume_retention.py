"""Retention across restarts: a resumed run continues the run it resumed from, so ``keep_last`` reaches back.

Each "process" is a fresh store and checkpointer (a new run id), exactly what a restarted script builds.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.errors import CheckpointError, ManifestError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _plain_process(uri: str, steps: range, *, resume: bool) -> tuple[str, int | None]:
    """One run of a plain loop: optionally resume, then save each step with keep_last=3."""
    model = torch.nn.Linear(4, 2)
    store = CheckpointStore(uri)
    resumed = None
    if resume:
        info = store.resume()
        assert info is not None
        with store.open(info.step, "checkpoint.ckpt") as f:
            model.load_state_dict(torch.load(f, weights_only=True)["model"])
        resumed = info.step
    with AsyncCheckpointer(store, keep_last=3) as ckpt:
        for step in steps:
            ckpt.save(step, {"model": model.state_dict()}).result(timeout=60)
    return store.run_id, resumed


def test_plain_loop_restart_keeps_keep_last_generations_in_total(tmp_path):
    uri = str(tmp_path / "store")
    first_run, _ = _plain_process(uri, range(1, 6), resume=False)
    second_run, resumed = _plain_process(uri, range(6, 9), resume=True)
    assert resumed == 5
    gens = CheckpointStore(uri, check_writable=False).generations()
    assert [g.step for g in gens] == [6, 7, 8]  # not [3, 4, 5, 6, 7, 8]
    assert second_run == first_run and {g.run_id for g in gens} == {first_run}


def test_a_fresh_run_without_resume_stays_a_separate_run(tmp_path):
    uri = str(tmp_path / "store")
    first_run, _ = _plain_process(uri, range(1, 4), resume=False)
    second_run, _ = _plain_process(uri, range(10, 14), resume=False)
    gens = CheckpointStore(uri, check_writable=False).generations()
    # The second run never deletes what it did not write: the first run's generations stay.
    assert second_run != first_run
    assert [g.step for g in gens if g.run_id == first_run] == [1, 2, 3]
    assert [g.step for g in gens if g.run_id == second_run] == [11, 12, 13]


def test_resume_of_an_empty_store_keeps_the_run_id_and_a_missing_step_raises(tmp_path):
    store = CheckpointStore(str(tmp_path / "empty"))
    run_id = store.run_id
    assert store.resume() is None and store.run_id == run_id
    with pytest.raises(ManifestError, match="not committed"):
        store.resume(step=3)


def test_resume_after_the_first_save_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path / "s"))
    writer = store.begin(1)
    try:
        with pytest.raises(CheckpointError, match="before the first save"):
            store.resume()
    finally:
        writer.abort()


# -- Accelerate -----------------------------------------------------------------------------------------------
def test_accelerate_restart_keeps_keep_last_generations_in_total(tmp_path):
    pytest.importorskip("accelerate")
    from lightning_async_ckpt.accelerate import attach, load_state, save_state
    from tests.helpers.accelerate_runs import make_run, reset_accelerate, train

    uri = str(tmp_path / "store")
    try:
        first = make_run()
        ckpt = attach(first.acc, uri, keep_last=3)
        first_run = ckpt.run_id
        for _ in range(5):
            train(first, 1)
            save_state(first.acc, uri)
        ckpt.close()
        assert [g.step for g in CheckpointStore(uri, check_writable=False).generations()] == [3, 4, 5]

        second = make_run(seed=1)  # the restarted process: a new Accelerator, a new attach, a new run id
        ckpt = attach(second.acc, uri, keep_last=3)
        assert ckpt.run_id != first_run
        assert load_state(second.acc, uri).step == 5
        assert ckpt.run_id == first_run and ckpt.step == 5
        for _ in range(3):
            train(second, 1)
            save_state(second.acc, uri)
        ckpt.close()
    finally:
        reset_accelerate()
    gens = CheckpointStore(uri, check_writable=False).generations()
    assert [g.step for g in gens] == [6, 7, 8]  # not [3, 4, 5, 6, 7, 8]
    assert {g.run_id for g in gens} == {first_run}


def test_last_resumes_from_a_model_checkpoint_last_file_left_in_dirpath(tmp_path):
    # Replacing ModelCheckpoint(save_last=True) by this callback in an existing script: "last" must resume from the
    # last.ckpt ModelCheckpoint left there (it used to find nothing and train from scratch), and once this
    # callback committed newer generations, from those.
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
    from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

    def fit(callback, max_steps, ckpt_path=None, seen=None):
        class Counting(BNDropoutModel):
            def training_step(self, batch, batch_idx):
                if seen is not None:
                    seen.append(self.trainer.global_step)
                return super().training_step(batch, batch_idx)

        pl.seed_everything(5)
        trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
        trainer.fit(Counting(), make_loader(), ckpt_path=ckpt_path)
        return trainer

    root = tmp_path / "ckpt"
    fit(ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_last=True), max_steps=6)
    assert (root / "last.ckpt").exists()
    seen: list[int] = []
    ours = AsyncCheckpointCallback(dirpath=str(root), every_n_train_steps=2, save_last=True, save_top_k=-1)
    fit(ours, max_steps=10, ckpt_path="last", seen=seen)
    assert seen[0] == 6  # resumed from last.ckpt, not from scratch
    assert [g.step for g in CheckpointStore(str(root), check_writable=False).generations()] == [8, 10]
    seen.clear()
    fit(
        AsyncCheckpointCallback(dirpath=str(root), every_n_train_steps=2, save_last=True, save_top_k=-1),
        12,
        "last",
        seen,
    )
    assert seen[0] == 10  # now the newest committed generation, newer than last.ckpt
