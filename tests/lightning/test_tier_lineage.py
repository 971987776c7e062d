"""Run lineage in a shared local tier (issue 37): a local generation records the durable tier it belongs to, so a run
never resumes another run's local generation, even when the local folder holds only that other run's."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


def _run(durable, local, max_steps, ckpt_path=None):
    pl.seed_everything(7)
    callback = AsyncCheckpointCallback(
        dirpath=str(durable), every_n_train_steps=4, local_dirpath=str(local), local_every_n_train_steps=2
    )
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
    starts = []

    class Start(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            starts.append(trainer.global_step)

    trainer.callbacks.append(Start())
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return starts[0]


def _steps(path):
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


def test_a_run_never_resumes_the_local_generations_of_another_run_that_alone_fill_the_folder(tmp_path):
    shared = tmp_path / "shared"
    _run(tmp_path / "durable-a", tmp_path / "node-a", 4)  # run A: its local tier on another node, step 4 durable
    _run(tmp_path / "durable-b", shared, 10)  # run B alone fills this node's local folder with newer steps
    b_local = _steps(shared)
    assert b_local and max(b_local) == 10 and _steps(tmp_path / "durable-a") == [4]
    store_a = CheckpointStore(str(tmp_path / "durable-a"), check_writable=False)
    expected = store_a.object_url(4, "checkpoint.ckpt")
    assert latest_checkpoint(str(tmp_path / "durable-a"), local_dirpath=str(shared)) == expected
    # Run A restarts on this node: it resumes its own durable step 4, not run B's step 10, and keeps B's data.
    assert _run(tmp_path / "durable-a", shared, 6, ckpt_path="last") == 4
    assert set(b_local) <= set(_steps(shared))
