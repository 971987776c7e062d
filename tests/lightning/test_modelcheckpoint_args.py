"""Issue 15, finding 1: ModelCheckpoint's arguments are accepted; what cannot be supported is a ConfigError naming
the alternative (never a bare TypeError)."""

from __future__ import annotations

import logging
from datetime import timedelta

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback
from lightning_async_ckpt.errors import ConfigError
from tests.helpers.models import make_loader, trainer_kwargs
from tests.helpers.selection import ValModel, committed, step_of

# Every ModelCheckpoint __init__ argument, with a value a user would pass.
MODEL_CHECKPOINT_ARGS = {
    "dirpath": "ckpts",
    "filename": "{epoch}-{step}-{val_loss:.2f}",
    "monitor": "val_loss",
    "verbose": True,
    "save_last": True,
    "save_top_k": 3,
    "save_on_exception": False,
    "save_weights_only": False,
    "mode": "max",
    "auto_insert_metric_name": False,
    "every_n_train_steps": 100,
    "train_time_interval": timedelta(minutes=30),
    "every_n_epochs": None,
    "save_on_train_epoch_end": False,
    "enable_version_counter": False,
}


def test_every_model_checkpoint_argument_is_accepted_by_name():
    import inspect

    assert set(MODEL_CHECKPOINT_ARGS) == set(inspect.signature(ModelCheckpoint.__init__).parameters) - {"self"}
    cb = AsyncCheckpointCallback(**MODEL_CHECKPOINT_ARGS)
    for name in ("filename", "monitor", "verbose", "save_last", "save_top_k", "save_weights_only", "mode"):
        assert getattr(cb, name) == MODEL_CHECKPOINT_ARGS[name], name
    assert cb.auto_insert_metric_name is False and cb._train_time_interval == timedelta(minutes=30)
    assert cb._every_n_train_steps == 100 and cb._save_on_train_epoch_end is False


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"save_top_k": 3}, ("save_top_k=3", "monitor", "keep_last")),
        ({"save_top_k": 1, "keep_last": 2}, ("save_top_k=1", "keep_last=2")),
        ({"mode": "maximum"}, ("mode", "'min' or 'max'")),
        ({"train_time_interval": 60}, ("train_time_interval", "timedelta")),
        ({"train_time_interval": timedelta(seconds=-1)}, ("train_time_interval",)),
        ({"monitor": "val_loss", "keep_last": 0}, ("keep_last",)),
        ({"save_last": "copy"}, ("save_last", "'link'")),
    ],
)
def test_unsupported_or_bad_values_are_config_errors_naming_the_alternative(kwargs, names):
    with pytest.raises(ConfigError) as info:
        AsyncCheckpointCallback(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_save_last_link_keeps_the_newest_generation_without_a_copy(tmp_path):
    # ModelCheckpoint's "link" makes last.ckpt a link to the newest file instead of a copy: here "last" always is
    # the newest committed generation, never a second copy of it.
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_loss", save_top_k=1, save_last="link")
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=3))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    kept = committed(tmp_path)
    assert step_of(ours.last_model_path) == max(kept) == 24
    assert set(kept) == {step_of(ours.best_model_path), 24}


def test_monitor_missing_after_validation_is_a_config_error_with_the_hint(tmp_path):
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_los")
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=2))
    with pytest.raises(ConfigError, match="log\\('val_los', value\\)"):
        trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))


def test_a_missing_monitor_is_the_misconfiguration_exception_model_checkpoint_raises(tmp_path):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_los")
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=2))
    with pytest.raises(MisconfigurationException) as info:  # what code written for ModelCheckpoint catches
        trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    assert isinstance(info.value, ConfigError)
    assert "val_loss" in str(info.value) and "ckpt/" not in str(info.value)  # the user's metrics, not ours


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_n_epochs": 0, "every_n_train_steps": 4},  # epoch ends disabled: the step interval only
        {"every_n_train_steps": 0, "every_n_epochs": 2},  # step interval disabled: every second epoch
        {"every_n_epochs": 0, "every_n_train_steps": 0},  # nothing but the final checkpoint
    ],
)
def test_zero_intervals_disable_a_schedule_like_model_checkpoint(tmp_path, kwargs):
    pl.seed_everything(3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", filename="{step}", save_top_k=-1, **kwargs)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=-1, save_on_train_end=False, **kwargs)
    trainer = pl.Trainer(callbacks=[sync, ours], **trainer_kwargs(max_epochs=4))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    saved = sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "sync").glob("*.ckpt"))
    assert sorted(committed(tmp_path / "async")) == saved
    if kwargs["every_n_epochs"] == 0 and kwargs["every_n_train_steps"] == 0:
        assert saved == []


def test_verbose_prints_model_checkpoint_lines_through_rank_zero_info(tmp_path, caplog):
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_loss", save_top_k=1, verbose=True)
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=4))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning.pytorch.utilities.rank_zero"]
    assert any("'val_loss' reached" in line and "as top 1" in line and "committed" in line for line in lines)
    # With this seed some epoch does not improve val_loss: ModelCheckpoint's "was not in top" line.
    assert any("'val_loss' was not in top 1" in line for line in lines), lines


def test_save_top_k_zero_with_save_last_keeps_only_the_newest_like_last_ckpt(tmp_path):
    pl.seed_everything(3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=0, save_last=True)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=0, save_last=True)
    trainer = pl.Trainer(callbacks=[sync, ours], **trainer_kwargs(max_epochs=3))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["last.ckpt"]
    assert set(committed(tmp_path / "async")) == {24} and step_of(ours.last_model_path) == 24


def test_keep_last_beside_monitor_keeps_the_newest_n_besides_the_best(tmp_path):
    # Every epoch's score enters the top 1 (the step, maximized): top-k alone keeps one generation, keep_last=2 two.
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="step", mode="max", save_top_k=1, keep_last=2)
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=4))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    assert set(committed(tmp_path)) == {24, 32} and step_of(ours.best_model_path) == 32
    assert list(map(step_of, ours.best_k_models)) == [32]


def test_two_callbacks_on_one_dirpath_are_refused_at_setup_before_any_step(tmp_path):
    # ModelCheckpoint(monitor=...) + ModelCheckpoint(every_n_train_steps=5) in one folder is common (their file
    # names differ); two of these callbacks would collide at a step both save, possibly the last one of the fit.
    best = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_loss")
    periodic = AsyncCheckpointCallback(dirpath=str(tmp_path) + "/", every_n_train_steps=5, save_top_k=-1)
    model = ValModel()
    trainer = pl.Trainer(callbacks=[best, periodic], **trainer_kwargs(max_epochs=3))
    with pytest.raises(ConfigError, match="own dirpath"):
        trainer.fit(model, make_loader(n=64), make_loader(n=32, seed=1))
    assert trainer.global_step == 0
    assert not committed(tmp_path)
    # Their own folders work.
    best = AsyncCheckpointCallback(dirpath=str(tmp_path / "best"), monitor="val_loss")
    periodic = AsyncCheckpointCallback(dirpath=str(tmp_path / "periodic"), every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(callbacks=[best, periodic], **trainer_kwargs(max_epochs=3))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    assert sorted(committed(tmp_path / "periodic"))[:2] == [5, 10]
