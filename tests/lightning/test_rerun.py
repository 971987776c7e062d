"""Re-running a script with the same ``dirpath``: decided before training, never mixing two runs' generations."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.errors import GenerationExistsError
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


def _fit(callback, *, max_steps, ckpt_path=None, seen=None):
    class Counting(BNDropoutModel):
        def training_step(self, batch, batch_idx):
            if seen is not None:
                seen.append(self.trainer.global_step)
            return super().training_step(batch, batch_idx)

    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
    trainer.fit(Counting(), make_loader(), ckpt_path=ckpt_path)
    return trainer


def _steps_and_runs(uri):
    gens = CheckpointStore(uri, check_writable=False).generations()
    return [g.step for g in gens], {g.run_id for g in gens}


def test_a_second_fresh_run_writes_a_new_version_and_never_mixes(tmp_path):
    root = str(tmp_path / "ckpt")
    first = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    _fit(first, max_steps=4)
    second = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    with pytest.warns(UserWarning, match="writes to .*v1"):
        trainer = _fit(second, max_steps=6)  # collided at step 2 before: must train to the end
    assert trainer.global_step == 6
    assert _steps_and_runs(root) == ([2, 4], {first.run_id})  # the first run is untouched
    assert _steps_and_runs(f"{root}/v1") == ([2, 4, 6], {second.run_id})
    # A third fresh run takes the next version.
    with pytest.warns(UserWarning, match="writes to .*v2"):
        _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=2)
    assert _steps_and_runs(f"{root}/v2")[0] == [2]


def test_resuming_with_last_continues_the_same_run_in_place(tmp_path):
    root = str(tmp_path / "ckpt")
    first = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    _fit(first, max_steps=4)
    seen: list[int] = []
    resumed = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    trainer = _fit(resumed, max_steps=8, ckpt_path="last", seen=seen)
    assert seen[0] == 4 and trainer.global_step == 8
    assert _steps_and_runs(root) == ([2, 4, 6, 8], {first.run_id})
    assert not (tmp_path / "ckpt" / "v1").exists()


def test_last_picks_the_newest_version_and_continues_it(tmp_path):
    root = str(tmp_path / "ckpt")
    _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=8)
    with pytest.warns(UserWarning, match="v1"):
        _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=4)
    # The highest version's newest step is v1's step 4 (not the first run's higher step 8 in dirpath).
    assert latest_checkpoint(root).endswith("v1/step-00000004/epoch=0-step=4.ckpt")
    seen: list[int] = []
    _fit(
        AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1),
        max_steps=6,
        ckpt_path="last",
        seen=seen,
    )
    assert seen[0] == 4
    assert _steps_and_runs(f"{root}/v1")[0] == [2, 4, 6]
    assert _steps_and_runs(root)[0] == [2, 4, 6, 8]
    assert not (tmp_path / "ckpt" / "v2").exists()


def test_resuming_an_older_step_branches_into_a_new_version(tmp_path):
    root = str(tmp_path / "ckpt")
    _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=6)
    older = CheckpointStore(root, check_writable=False).object_url(2, "checkpoint.ckpt")
    with pytest.warns(UserWarning, match="v1"):
        _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=6, ckpt_path=older)
    assert _steps_and_runs(root)[0] == [2, 4, 6]
    assert _steps_and_runs(f"{root}/v1")[0] == [4, 6]


def test_without_the_version_counter_a_rerun_is_refused_before_training(tmp_path):
    root = str(tmp_path / "ckpt")
    _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=4)
    seen: list[int] = []
    callback = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    callback._enable_version_counter = False  # what enable_version_counter=False sets
    with pytest.raises(GenerationExistsError, match="ckpt_path='last'.*enable_version_counter=True") as info:
        _fit(callback, max_steps=4, seen=seen)
    assert "new dirpath" in str(info.value)
    assert seen == []  # decided before the first training step
    assert _steps_and_runs(root)[0] == [2, 4]


@pytest.mark.parametrize("how", ["latest_checkpoint", "last"])
def test_resuming_the_newest_checkpoint_with_changed_arguments_continues_in_place(tmp_path, how):
    # Other callback arguments change Lightning's callback state key, so the callback's saved state (and the run id
    # in it) is not restored; resuming from the newest checkpoint of dirpath is still a continuation of that run.
    root = str(tmp_path / "ckpt")
    first = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2)
    _fit(first, max_steps=4)
    seen: list[int] = []
    resumed = AsyncCheckpointCallback(dirpath=root, every_n_train_steps=3, keep_last=2)
    ckpt_path = latest_checkpoint(root) if how == "latest_checkpoint" else "last"
    _fit(resumed, max_steps=9, ckpt_path=ckpt_path, seen=seen)
    assert seen[0] == 4
    assert not (tmp_path / "ckpt" / "v1").exists()
    # One run: keep_last counts the generations it resumed from, as if it had never stopped.
    assert _steps_and_runs(root) == ([6, 9], {first.run_id})
    assert resumed.run_id == first.run_id


def test_resuming_the_newest_checkpoint_of_a_copied_folder_continues_in_the_copy(tmp_path):
    import shutil

    first_dir = tmp_path / "first"
    first = AsyncCheckpointCallback(dirpath=str(first_dir), every_n_train_steps=2, save_top_k=-1)
    _fit(first, max_steps=4)
    copy = tmp_path / "copy"
    shutil.copytree(first_dir, copy)
    resumed = AsyncCheckpointCallback(dirpath=str(copy), every_n_train_steps=2, save_top_k=-1)
    _fit(resumed, max_steps=6, ckpt_path=latest_checkpoint(str(copy)))
    assert _steps_and_runs(str(copy)) == ([2, 4, 6], {first.run_id})
    assert not (copy / "v1").exists()
    assert _steps_and_runs(str(first_dir))[0] == [2, 4]  # the original is untouched


def test_a_newer_step_with_a_manifest_this_version_rejects_is_never_continued_into(tmp_path):
    import json

    root = tmp_path / "ckpt"
    first = AsyncCheckpointCallback(dirpath=str(root), every_n_train_steps=2, save_top_k=-1)
    _fit(first, max_steps=4)
    # Step 6 holds a manifest written by a newer format version: not a readable generation, but a step that is
    # never written again. Resuming from step 4 in place would collide with it at step 6.
    planted = root / "step-00000006"
    planted.mkdir()
    body = json.loads((root / "step-00000004" / "manifest.json").read_text())
    body.update(step=6, format_version=99)
    (planted / "manifest.json").write_text(json.dumps(body))
    resumed = AsyncCheckpointCallback(dirpath=str(root), every_n_train_steps=2, save_top_k=-1)
    with pytest.warns(UserWarning, match="v1"):
        trainer = _fit(resumed, max_steps=8, ckpt_path="last")
    assert trainer.global_step == 8
    assert json.loads((planted / "manifest.json").read_text())["format_version"] == 99
    assert _steps_and_runs(f"{root}/v1")[0] == [6, 8]


@pytest.mark.parametrize("retention", [{"save_top_k": -1}, {"keep_last": 2}])
def test_last_after_a_branch_continues_the_branch_and_leaves_the_first_history_alone(tmp_path, retention):
    # Fit to 6; resume the older step 4 (branches into v1: steps 6, 8); then "last" restores v1's step 8. Both
    # branches carry the same run id (it travels in the checkpoint): the fit must continue where it resumed from, v1,
    # never in dirpath, whose steps 4 and 6 the branch promised to leave alone (keep_last used to delete them).
    root = str(tmp_path / "ckpt")
    _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, **retention), max_steps=6)
    older = CheckpointStore(root, check_writable=False).object_url(4, "checkpoint.ckpt")
    with pytest.warns(UserWarning, match="writes to .*v1"):
        _fit(
            AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, **retention),
            max_steps=8,
            ckpt_path=older,
        )
    before = _steps_and_runs(root)[0]
    seen: list[int] = []
    _fit(
        AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, **retention),
        max_steps=12,
        ckpt_path="last",
        seen=seen,
    )
    assert seen[0] == 8
    assert _steps_and_runs(root)[0] == before  # the first history: untouched
    assert _steps_and_runs(f"{root}/v1")[0] == ([10, 12] if "keep_last" in retention else [6, 8, 10, 12])
    assert not (tmp_path / "ckpt" / "v2").exists()


class _Scored(BNDropoutModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("score", float(self.global_step + 1))  # mode min: the earliest save is the best
        return loss


@pytest.mark.parametrize("monitor", ["score", None])
def test_a_second_fit_of_the_same_callback_from_scratch_keeps_its_own_newest(tmp_path, monitor):
    # The same callback object fits again from step 0 (no ckpt_path): it writes to v1 (dirpath holds later steps)
    # and must keep its own newest generation there (its "last"); the first fit's entries used to count as newer
    # and retention deleted the second fit's checkpoints, its final one included.
    root = str(tmp_path / "ckpt")
    args = dict(save_top_k=1, save_last=True, every_n_train_steps=2)
    ours = AsyncCheckpointCallback(dirpath=root, monitor=monitor, **args)
    pl.seed_everything(7)
    pl.Trainer(max_steps=10, callbacks=[ours], **trainer_kwargs()).fit(_Scored(), make_loader())
    before = _steps_and_runs(root)[0]
    with pytest.warns(UserWarning, match="writes to .*v1"):
        pl.Trainer(max_steps=4, callbacks=[ours], **trainer_kwargs()).fit(_Scored(), make_loader())
    assert _steps_and_runs(root)[0] == before
    assert 4 in _steps_and_runs(f"{root}/v1")[0]
    assert ours.last_model_path.startswith(f"{root}/v1/step-00000004/")
    if monitor is None:
        assert ours.best_model_path == ours.last_model_path  # ModelCheckpoint: the newest save of this fit


def test_continuing_a_branch_keeps_the_best_of_the_history_it_branched_from(tmp_path):
    # dirpath's step 2 is the best (the earliest score); a resume of step 2 branches into v1, where it stays best;
    # "last" then continues v1: step 2 must still be best (ModelCheckpoint's restored best_k_models keep it).
    root = str(tmp_path / "ckpt")

    def callback():
        return AsyncCheckpointCallback(dirpath=root, monitor="score", save_top_k=1, every_n_train_steps=2)

    def fit(max_steps, ckpt_path=None):
        cb = callback()
        pl.seed_everything(7)
        pl.Trainer(max_steps=max_steps, callbacks=[cb], **trainer_kwargs()).fit(
            _Scored(), make_loader(), ckpt_path=ckpt_path
        )
        return cb

    first = fit(6)
    best = first.best_model_path
    assert "/step-00000002/" in best
    with pytest.warns(UserWarning, match="writes to .*v1"):
        assert fit(8, ckpt_path=best).best_model_path == best
    assert fit(10, ckpt_path="last").best_model_path == best
    assert _steps_and_runs(f"{root}/v1")[0][-1] == 10
