"""Issue 39: habits ModelCheckpoint users bring (round 4) — retention by default, foreign files, both tiers, logs.

Real Trainers and real local folders.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, ConfigError
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


def _fit(callback, *, max_steps=8, root=None, ckpt_path=None):
    pl.seed_everything(7)
    kw = trainer_kwargs(default_root_dir=root) if root else trainer_kwargs()
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **kw)
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer


def _steps(path):
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


# -- point 6: the two tiers in one place -------------------------------------------------------------------
@pytest.mark.parametrize("local", ["ckpt", "ckpt/local", "."])
def test_local_dirpath_overlapping_dirpath_is_refused_at_construction(tmp_path, local):
    with pytest.raises(ConfigError, match="local_dirpath .* dirpath") as info:
        AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2, local_dirpath=str(tmp_path / local))
    assert "separate" in str(info.value)


def test_local_dirpath_inside_the_default_dirpath_is_refused_before_training(tmp_path):
    # dirpath=None: <default_root_dir>/checkpoints, known at setup.
    cb = AsyncCheckpointCallback(
        every_n_train_steps=2, local_dirpath=str(tmp_path / "checkpoints" / "local"), local_every_n_train_steps=1
    )
    with pytest.raises(ConfigError, match="local_dirpath"):
        _fit(cb, root=str(tmp_path))
    assert not (tmp_path / "checkpoints" / "local").exists()


def test_an_unusable_local_dirpath_is_reported_under_its_own_name(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cb = AsyncCheckpointCallback(
        str(tmp_path / "ckpt"), every_n_train_steps=2, local_dirpath=str(blocker / "local"), local_every_n_train_steps=1
    )
    with pytest.raises(ConfigError) as info:
        _fit(cb)
    assert str(info.value).startswith(f"local_dirpath {str(blocker / 'local')!r} is not writable")


# -- point 1: retention by default, like ModelCheckpoint(save_top_k=1) without monitor -------------------------
def test_by_default_only_the_newest_generation_is_kept_like_model_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    theirs = ModelCheckpoint(str(tmp_path / "theirs"), every_n_train_steps=4)
    ours = AsyncCheckpointCallback(str(tmp_path / "ours"), every_n_train_steps=4)
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=12, callbacks=[theirs, ours], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader())
    assert len(list((tmp_path / "theirs").iterdir())) == 1  # ModelCheckpoint keeps one file
    assert _steps(tmp_path / "ours") == [12]
    assert ours.save_top_k == theirs.save_top_k == 1 and ours.options.keep_last == 1


def test_save_top_k_minus_one_keeps_every_generation(tmp_path):
    _fit(AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1), max_steps=12)
    assert _steps(tmp_path / "ckpt") == [4, 8, 12]


def test_by_default_with_both_tiers_dirpath_keeps_the_newest(tmp_path):
    cb = AsyncCheckpointCallback(
        str(tmp_path / "durable"),
        every_n_train_steps=4,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=2,
    )
    _fit(cb, max_steps=12)
    assert _steps(tmp_path / "durable") == [12]
    assert _steps(tmp_path / "local")[-1] == 12


# -- point 8: visible lines, the last metric --------------------------------------------------------------
_RANK_ZERO = "lightning.pytorch.utilities.rank_zero"  # where ModelCheckpoint's verbose lines go (rank_zero_info)


def test_verbose_and_the_final_line_go_through_lightnings_rank_zero_info(tmp_path, caplog):
    import logging

    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2, verbose=True)
    with caplog.at_level(logging.INFO):
        _fit(cb, max_steps=4)
    shown = [r.getMessage() for r in caplog.records if r.name == _RANK_ZERO]
    assert any("committed checkpoint step 2" in m for m in shown), shown
    assert any("final committed checkpoint step 4" in m for m in shown), shown


def test_logged_metrics_end_on_the_final_committed_step(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    pl.seed_everything(0)
    kw = trainer_kwargs(max_steps=16, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=1)
    trainer = pl.Trainer(callbacks=[cb], **kw)
    trainer.fit(BNDropoutModel(), make_loader())
    assert cb.committed_step == 16
    assert int(trainer.logged_metrics["ckpt/committed_step"]) == 16
    assert int(trainer.callback_metrics["ckpt/committed_step"]) == 16


# -- point 2: files the library never wrote -------------------------------------------------------------------
def test_retention_leaves_a_step_folder_it_never_wrote_and_warns_once(tmp_path, caplog):
    import logging

    dirpath = tmp_path / "ckpt"
    (dirpath / "step-00000002").mkdir(parents=True)
    (dirpath / "step-00000002" / "notes.txt").write_text("mine")  # no manifest, no claim: not the library's
    cb = AsyncCheckpointCallback(str(dirpath), every_n_train_steps=4)
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        _fit(cb, max_steps=12)
    assert (dirpath / "step-00000002" / "notes.txt").read_text() == "mine"
    assert _steps(dirpath) == [12]
    warnings = [r.getMessage() for r in caplog.records if "step-00000002" in r.getMessage()]
    assert len(warnings) == 1 and "not written by" in warnings[0], warnings


def test_a_step_folder_holding_foreign_files_is_written_beside_them_never_replaced(tmp_path, caplog):
    import logging

    dirpath = tmp_path / "ckpt"
    (dirpath / "step-00000004").mkdir(parents=True)
    (dirpath / "step-00000004" / "notes.txt").write_text("mine")
    cb = AsyncCheckpointCallback(str(dirpath), every_n_train_steps=4)
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        _fit(cb, max_steps=8)
    assert (dirpath / "step-00000004" / "notes.txt").read_text() == "mine"  # written beside, then retained
    assert _steps(dirpath) == [8]
    assert any("notes.txt" in r.getMessage() for r in caplog.records)


def test_retention_of_a_generation_beside_foreign_files_removes_only_its_own(tmp_path):
    dirpath = tmp_path / "ckpt"
    _fit(AsyncCheckpointCallback(str(dirpath), every_n_train_steps=4, save_top_k=-1), max_steps=8)
    (dirpath / "step-00000004" / "notes.txt").write_text("mine")  # a user's file put into a committed generation
    store = CheckpointStore(str(dirpath), check_writable=False)
    store.run_id = CheckpointStore(str(dirpath), check_writable=False).manifest(4).run_id
    store.retain(1)
    assert _steps(dirpath) == [8]
    assert sorted(p.name for p in (dirpath / "step-00000004").iterdir()) == ["notes.txt"]


# -- point 11: how far the durable tier is behind -----------------------------------------------------------
def test_with_two_tiers_the_durable_lag_is_a_metric(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    cb = AsyncCheckpointCallback(
        str(tmp_path / "durable"),
        every_n_train_steps=2,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=1,
    )
    pl.seed_everything(0)
    logger = CSVLogger(tmp_path / "logs")
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_steps=6, logger=logger, log_every_n_steps=1))
    trainer.fit(BNDropoutModel(), make_loader())
    assert int(trainer.logged_metrics["ckpt/durable_lag"]) >= 0
    assert "ckpt/durable_lag" in (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
