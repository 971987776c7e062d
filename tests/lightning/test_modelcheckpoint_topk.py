"""Issue 15, finding 1: ModelCheckpoint's selection arguments, checked against a real ModelCheckpoint in the same run.

Both callbacks sit in one Trainer, so they see the same metrics at the same steps; what ModelCheckpoint keeps
(its files, ``best_k_models``, ``best_model_path`` and score) must be what this callback keeps and commits.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs
from tests.helpers.selection import committed, fit, step_of, step_of_file


def steps_of_files(folder) -> set[int]:
    """Steps of ModelCheckpoint's files named with ``step=N`` (``last.ckpt`` excluded)."""
    return {int(re.search(r"step=(\d+)", f).group(1)) for f in os.listdir(folder) if f.startswith("epoch")}


MC_ARGS = dict(monitor="val_loss", filename="{epoch}-{step}-{val_loss:.4f}")


@pytest.mark.parametrize(
    ("mode", "top_k", "monitor"), [("min", 2, "val_loss"), ("max", 1, "val_acc"), ("min", -1, "val_loss")]
)
@pytest.mark.parametrize("final", [False, True])
def test_top_k_by_monitored_metric_keeps_what_model_checkpoint_keeps(tmp_path, mode, top_k, monitor, final):
    args = dict(MC_ARGS, monitor=monitor, mode=mode, save_top_k=top_k)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=final, **args)
    fit([sync, ours], max_epochs=6)

    kept = committed(tmp_path / "async")
    # The same generations on storage as files, named the same (the rendered template is in the manifest); the
    # final checkpoint (save_on_train_end) is ranked at the epoch end like ModelCheckpoint's save, and kept as
    # the newest besides.
    assert set(kept) - {48 if final else -1} == steps_of_files(tmp_path / "sync") - {48 if final else -1}
    assert set(kept) <= steps_of_files(tmp_path / "sync") | ({48} if final else set())
    files = {v["filename"] for s, v in kept.items() if v["ranked"]}
    assert files == set(os.listdir(tmp_path / "sync"))
    # best_k_models: the same steps and scores; best_model_path names the same step, a loadable committed file.
    theirs = {step_of_file(p): float(s) for p, s in sync.best_k_models.items()}
    assert {step_of(p): float(s) for p, s in ours.best_k_models.items()} == theirs
    assert step_of(ours.best_model_path) == step_of_file(sync.best_model_path)
    assert float(ours.best_model_score) == float(sync.best_model_score)
    assert step_of(ours.kth_best_model_path) == step_of_file(sync.kth_best_model_path)
    assert torch.load(ours.best_model_path, weights_only=False)["global_step"] == step_of(ours.best_model_path)
    assert all(kept[step_of(p)]["score"] == pytest.approx(float(s)) for p, s in ours.best_k_models.items())


@pytest.mark.parametrize("every", [{}, {"every_n_train_steps": 4}])
def test_top_k_with_save_last_keeps_top_k_and_last_ckpt(tmp_path, every):
    # At epoch/validation ends ModelCheckpoint writes last.ckpt only beside a top-k save; at batch-end interval
    # saves always.
    args = dict(MC_ARGS, save_top_k=2, save_last=True, **every)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    fit([sync, ours], max_epochs=6)
    last_step = torch.load(sync.last_model_path, weights_only=False)["global_step"]
    assert set(committed(tmp_path / "async")) == steps_of_files(tmp_path / "sync") | {last_step}
    assert step_of(ours.last_model_path) == last_step
    assert set(ours.best_k_models) <= {
        CheckpointStore(str(tmp_path / "async")).object_url(s, "checkpoint.ckpt") for s in committed(tmp_path / "async")
    }


@pytest.mark.parametrize(("top_k", "steps"), [(1, {24}), (-1, {8, 16, 24})])
def test_no_monitor_top_1_keeps_the_newest_and_top_minus_1_keeps_all(tmp_path, top_k, steps):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=top_k)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=top_k)
    fit([sync, ours], max_epochs=3)
    assert set(committed(tmp_path / "async")) == steps_of_files(tmp_path / "sync") == steps
    assert step_of(ours.best_model_path) == step_of_file(sync.best_model_path) == 24
    assert ours.best_k_models == {} == sync.best_k_models and ours.best_model_score is None
    assert ours.save_top_k == top_k


def test_val_check_interval_half_saves_after_each_validation_like_model_checkpoint(tmp_path):
    # With two validation runs per epoch ModelCheckpoint saves after each of them, not at the epoch end only.
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=-1)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=-1)
    fit([sync, ours], max_epochs=2, val_check_interval=0.5)
    assert set(committed(tmp_path / "async")) == steps_of_files(tmp_path / "sync") == {4, 8, 12, 16}


def test_val_check_interval_half_top_k_by_validation_metric(tmp_path):
    args = dict(MC_ARGS, save_top_k=2)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    fit([sync, ours], max_epochs=3, val_check_interval=0.5)
    assert set(committed(tmp_path / "async")) == steps_of_files(tmp_path / "sync")
    assert step_of(ours.best_model_path) == step_of_file(sync.best_model_path)


def test_step_interval_with_validation_only_metric_defers_to_validation_like_model_checkpoint(tmp_path):
    # val_loss does not exist before the first validation, and at the last batch of an epoch it is stale:
    # ModelCheckpoint defers those saves to on_validation_end.
    args = dict(MC_ARGS, save_top_k=-1, every_n_train_steps=3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    fit([sync, ours], max_epochs=3)
    expected = steps_of_files(tmp_path / "sync")
    assert set(committed(tmp_path / "async")) == expected
    assert {v["filename"] for v in committed(tmp_path / "async").values()} == set(os.listdir(tmp_path / "sync"))


def test_every_n_epochs_two_with_validation_every_epoch(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=-1, every_n_epochs=2)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=-1, every_n_epochs=2)
    fit([sync, ours], max_epochs=5, check_val_every_n_epoch=2)
    # The final checkpoint (step 40) is this callback's save_on_train_end; the others are ModelCheckpoint's.
    assert set(committed(tmp_path / "async")) == steps_of_files(tmp_path / "sync") | {40}
    assert steps_of_files(tmp_path / "sync") == {16, 32}


def test_train_time_interval_zero_saves_at_every_batch_like_model_checkpoint(tmp_path):
    args = dict(save_top_k=-1, train_time_interval=timedelta(0))
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), **args)
    fit([sync, ours], max_epochs=1, limit_val_batches=0)
    assert set(committed(tmp_path / "async")) == steps_of_files(tmp_path / "sync") == set(range(1, 9))


def test_save_weights_only_writes_what_model_checkpoint_writes(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_weights_only=True, filename="{step}")
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_weights_only=True)
    fit([sync, ours], max_epochs=1)
    theirs = torch.load(tmp_path / "sync" / "step=8.ckpt", weights_only=False)
    mine = torch.load(ours.best_model_path, weights_only=False)
    assert set(mine) == set(theirs) and "optimizer_states" not in mine
    assert committed(tmp_path / "async")[8]["weights_only"] is True


def test_filename_template_auto_insert_metric_name_and_version_counter(tmp_path):
    # "ep{epoch}" renders the same name for every save of an epoch: ModelCheckpoint appends -v1, -v2.
    args = dict(filename="ep{epoch:02d}", auto_insert_metric_name=False, every_n_train_steps=3)
    args.update(monitor="step", mode="max", save_top_k=-1)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    fit([sync, ours], max_epochs=1, limit_val_batches=0)
    names = sorted(v["filename"] for v in committed(tmp_path / "async").values())
    assert names == sorted(os.listdir(tmp_path / "sync")) == ["ep00-v1.ckpt", "ep00.ckpt"]


def test_filename_without_monitor_reuses_the_replaced_name_like_model_checkpoint(tmp_path):
    # Without a monitor ModelCheckpoint overwrites its newest file when the name repeats; every generation here is
    # kept (committed data is never overwritten), recorded under the same name.
    args = dict(filename="ep{epoch:02d}", every_n_train_steps=3, enable_version_counter=True, save_top_k=-1)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    fit([sync, ours], max_epochs=1, limit_val_batches=0)
    assert os.listdir(tmp_path / "sync") == ["epepoch=00.ckpt"]
    assert {v["filename"] for v in committed(tmp_path / "async").values()} == {"epepoch=00.ckpt"}
    assert set(committed(tmp_path / "async")) == {3, 6}


class TableScore(BNDropoutModel):
    """Logs ``score`` from a table by the step the batch ends at: NaN and ties included."""

    SCORES = {2: 0.5, 4: float("nan"), 6: 0.3, 8: 0.5, 10: 0.3, 12: float("nan"), 14: 0.2, 16: 0.5}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("score", self.SCORES.get(self.global_step + 1, 1.0))
        return loss


def _mc_state(ckpt: dict, prefix: str) -> dict:
    """A checkpoint's entries of the checkpoint callback whose state key starts with ``prefix``, by step."""
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith(prefix))

    def step(path):
        found = re.search(r"step[=-]0*(\d+)", str(path))
        return int(found.group(1)) if found else None

    def score(value):
        return None if value is None else repr(float(value))  # repr: nan and inf compare

    return {
        "best_model_path": step(state["best_model_path"]),
        "best_model_score": score(state["best_model_score"]),
        "best_k_models": {step(p): score(s) for p, s in state["best_k_models"].items()},
        "kth_best_model_path": step(state["kth_best_model_path"]),
        "kth_value": score(state["kth_value"]),
        "current_score": score(state["current_score"]),
    }


@pytest.mark.parametrize(("monitor", "mode"), [("score", "min"), ("score", "max"), (None, "min")])
def test_scores_ties_and_the_state_in_each_file_are_model_checkpoints(tmp_path, monitor, mode):
    # ModelCheckpoint records a NaN score as +inf (min) / -inf (max), names the oldest of tied worst scores its k-th
    # best, and writes its state into each file as it is once that file is saved (the file is its own best when it
    # enters, the one it displaces is gone). The same run, both callbacks: every attribute and every file's state.
    args = dict(monitor=monitor, mode=mode, save_top_k=-1, every_n_train_steps=2)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", filename="{step}", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    pl.seed_everything(3)
    trainer = pl.Trainer(callbacks=[sync, ours], max_steps=16, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(TableScore(), make_loader(n=128))
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    steps = [g.step for g in store.generations()]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16]
    for step in steps:
        theirs = torch.load(tmp_path / "sync" / f"step={step}.ckpt", weights_only=False)
        mine = torch.load(store.object_url(step, "checkpoint.ckpt"), weights_only=False)
        assert _mc_state(mine, "AsyncCheckpointCallback") == _mc_state(theirs, "ModelCheckpoint"), step
        own = next(v for k, v in mine["callbacks"].items() if k.startswith("AsyncCheckpointCallback"))
        assert store.object_url(step, "checkpoint.ckpt") in (
            own["best_k_models"] if monitor else [own["best_model_path"]]
        )
    live = {"callbacks": {"ModelCheckpoint": sync.state_dict(), "AsyncCheckpointCallback": ours.state_dict()}}
    assert _mc_state(live, "AsyncCheckpointCallback") == _mc_state(live, "ModelCheckpoint")


@pytest.mark.parametrize("top_k", [-1, 3])
def test_a_repeated_name_without_the_version_counter_replaces_that_entry_like_model_checkpoint(tmp_path, top_k):
    # enable_version_counter=False and a name that repeats: ModelCheckpoint overwrites the file and its best_k_models
    # entry (the newest score under that name). The generation it replaces is removed once the new one commits.
    args = dict(monitor="score", save_top_k=top_k, filename="fixed", enable_version_counter=False)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=2, **args)
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"), every_n_train_steps=2, save_on_train_end=False, **args
    )
    pl.seed_everything(3)
    trainer = pl.Trainer(callbacks=[sync, ours], max_steps=16, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(TableScore(), make_loader(n=128))
    live = {"callbacks": {"ModelCheckpoint": sync.state_dict(), "AsyncCheckpointCallback": ours.state_dict()}}
    assert _mc_state(live, "AsyncCheckpointCallback")["best_k_models"] == {16: repr(0.5)}
    assert repr(float(sync.best_model_score)) == repr(float(ours.best_model_score))
    assert os.listdir(tmp_path / "sync") == ["fixed.ckpt"]
    assert list(committed(tmp_path / "async")) == [16]
