"""Issue 28: what Lightning's own ``ModelCheckpoint`` tests expect of a drop-in, each against a real Trainer.

Six defects (a ``pathlib.Path`` dirpath, ``best_model_path`` with ``save_top_k=0``, dirpath normalisation, the
"last" lookup's class attributes, ``setup`` outside ``trainer.callbacks``, ``dirpath=""``), ``save_on_exception``,
``MisconfigurationException`` for ``ModelCheckpoint``'s bad values and its ``load_state_dict`` rule.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, latest_checkpoint
from lightning_async_ckpt.errors import ConfigError
from tests.helpers.models import make_loader, trainer_kwargs
from tests.helpers.selection import ValModel, committed, fit, step_of


# -- 1. a pathlib.Path dirpath ---------------------------------------------------------------------------------
def test_a_pathlib_path_dirpath_is_accepted_like_model_checkpoint(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=tmp_path / "ckpts", every_n_train_steps=4, save_top_k=-1)
    assert ours.dirpath == str(tmp_path / "ckpts") == ModelCheckpoint(dirpath=tmp_path / "ckpts").dirpath
    fit([ours], max_steps=8)
    assert set(committed(tmp_path / "ckpts")) == {4, 8}
    assert ours.best_model_path.startswith(str(tmp_path / "ckpts") + "/")


# -- 2. save_top_k=0 keeps no best -------------------------------------------------------------------------------
def test_save_top_k_zero_with_save_last_has_no_best_model_path_like_model_checkpoint(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=0, save_last=True)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=0, save_last=True)
    trainer, model = fit([sync, ours], max_epochs=2)
    assert set(committed(tmp_path / "async")) == {16} and step_of(ours.last_model_path) == 16
    assert ours.best_model_path == sync.best_model_path == ""
    assert ours.save_top_k == sync.save_top_k == 0
    # ckpt_path="best" fails as it does with ModelCheckpoint (ours is the one Lightning asks once alone).
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=2))
    with pytest.raises(ValueError, match="best"):
        trainer.validate(model, make_loader(n=32, seed=1), ckpt_path="best")


def test_save_top_k_zero_without_save_last_saves_nothing_like_model_checkpoint(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=0)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_top_k=0, every_n_train_steps=2)
    fit([sync, ours], max_epochs=2)
    assert not (tmp_path / "sync").exists() or not os.listdir(tmp_path / "sync")
    assert committed(tmp_path / "async") == {}
    assert ours.best_model_path == ours.last_model_path == ""


# -- 3. dirpath normalised like ModelCheckpoint ------------------------------------------------------------------
def test_dirpath_is_normalised_like_model_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    for given in ("~/ckpts", "rel/ckpts", "./link/ckpts", f"{tmp_path}/a/../b", "memory://bucket/ckpts"):
        assert AsyncCheckpointCallback(dirpath=given).dirpath == ModelCheckpoint(dirpath=given).dirpath, given
    assert AsyncCheckpointCallback(dirpath="~/ckpts").dirpath == str(tmp_path / "home" / "ckpts")
    assert AsyncCheckpointCallback(dirpath="./link/ckpts").dirpath == str(tmp_path / "real" / "ckpts")
    # A logger scanning checkpoint_callback.dirpath finds the generations there.
    ours = AsyncCheckpointCallback(dirpath="rel/ckpts", every_n_train_steps=4)
    trainer, _ = fit([ours], max_steps=4)
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "rel" / "ckpts")
    assert set(committed(tmp_path / "rel" / "ckpts")) == {4}


# -- 4. the "last" lookup honours CHECKPOINT_NAME_LAST and FILE_EXTENSION ------------------------------------------
def test_last_lookup_honours_checkpoint_name_last_and_file_extension(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    sync.CHECKPOINT_NAME_LAST, sync.FILE_EXTENSION = "final", ".pt"
    fit([sync], max_epochs=1)
    assert {"final.pt", "epoch=0-step=8.pt"} <= set(os.listdir(tmp_path))
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path))
    ours.CHECKPOINT_NAME_LAST, ours.FILE_EXTENSION = "final", ".pt"
    assert ours._find_last_checkpoints(pl.Trainer(**trainer_kwargs())) == {str(tmp_path / "final.pt")}
    trainer, _ = fit([ours], max_epochs=2, ckpt_path="last")
    assert str(trainer.ckpt_path).endswith("final.pt")
    assert step_of(ours.last_model_path or ours.best_model_path) == 16  # resumed at step 8, not from scratch


def test_last_lookup_lists_every_last_file_like_model_checkpoint(tmp_path):
    for name in ("last-v0.ckpt", "last-v1.ckpt", "other.pt", "log.txt"):
        (tmp_path / name).write_bytes(b"x")
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path))
    files = ours._find_last_checkpoints(pl.Trainer(**trainer_kwargs()))
    assert files == {str(tmp_path / "last-v0.ckpt"), str(tmp_path / "last-v1.ckpt")}


# -- 5. setup outside trainer.callbacks ----------------------------------------------------------------------------
def test_setup_of_a_callback_not_in_trainer_callbacks_does_not_crash(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpts"))
    trainer = pl.Trainer(default_root_dir=tmp_path, **trainer_kwargs())
    ours.setup(trainer, ValModel(), stage="fit")  # was a bare StopIteration
    assert ours.dirpath == str(tmp_path / "ckpts") and ours.store is not None
    ours.teardown(trainer, ValModel(), stage="fit")


# -- 6. dirpath="" ---------------------------------------------------------------------------------------------------
def test_empty_dirpath_names_files_relative_to_the_working_directory_like_model_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ours = AsyncCheckpointCallback(dirpath="", every_n_train_steps=4)
    sync = ModelCheckpoint(dirpath="")
    assert ours.dirpath == sync.dirpath == ""
    assert ours.format_checkpoint_name({"epoch": 5, "step": 4}) == sync.format_checkpoint_name({"epoch": 5, "step": 4})
    fit([ours], max_steps=4)
    assert ours.dirpath == str(tmp_path) and set(committed(tmp_path)) == {4}


# -- save_on_exception ------------------------------------------------------------------------------------------------
class RaisesAtStep(ValModel):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.raise_at = step
        self.at_exception: dict[str, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        if self.global_step == self.raise_at:
            self.at_exception = {k: v.detach().clone() for k, v in self.state_dict().items()}
            raise RuntimeError("Trouble!")
        return super().training_step(batch, batch_idx)


class SeesTheFile(pl.LightningDataModule):
    """Its ``on_exception`` runs after every callback's and before the exception propagates."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self.paths = paths
        self.seen: list[bool] = []

    def train_dataloader(self):
        return make_loader(n=64)

    def val_dataloader(self):
        return make_loader(n=32, seed=1)

    def on_exception(self, exception):
        self.seen = [p.is_file() for p in self.paths]


def test_save_on_exception_writes_model_checkpoints_file_before_the_exception_propagates(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", filename="exception", save_on_exception=True, every_n_epochs=7)
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"),
        filename="exception",
        save_on_exception=True,
        every_n_train_steps=2,
        save_top_k=-1,
    )
    probe = SeesTheFile([tmp_path / "sync" / "exception.ckpt", tmp_path / "async" / "exception.ckpt"])
    pl.seed_everything(3)
    model = RaisesAtStep(5)
    trainer = pl.Trainer(callbacks=[sync, ours], **trainer_kwargs(max_epochs=2))
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(model, datamodule=probe)
    assert probe.seen == [True, True]  # written inside on_exception, before the exception propagated
    theirs = torch.load(tmp_path / "sync" / "exception.ckpt", weights_only=False)
    mine = torch.load(tmp_path / "async" / "exception.ckpt", weights_only=False)
    assert mine["global_step"] == theirs["global_step"] == 5 and mine["epoch"] == theirs["epoch"]
    assert set(mine) == set(theirs)
    for key, value in model.at_exception.items():  # the state when the exception was raised
        assert torch.equal(mine["state_dict"][key], value), key
    # The saves in flight were drained; the exception file is no generation, "last" stays the newest cut.
    assert set(committed(tmp_path / "async")) == {2, 4}
    assert step_of(latest_checkpoint(str(tmp_path / "async"))) == 4


def test_save_on_exception_skips_a_step_already_saved_and_the_sanity_check(tmp_path):
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path), filename="exception", save_on_exception=True, every_n_train_steps=1, save_top_k=-1
    )
    pl.seed_everything(3)
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=2))

    class RaisesAtBatchStart(ValModel):
        def on_train_batch_start(self, batch, batch_idx):
            if self.global_step == 3:
                raise RuntimeError("Trouble!")

    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(RaisesAtBatchStart(), make_loader(n=64), make_loader(n=32, seed=1))
    assert not (tmp_path / "exception.ckpt").exists()  # step 3 was saved at its batch end, like ModelCheckpoint
    assert set(committed(tmp_path)) == {1, 2, 3}

    class RaisesInSanityCheck(ValModel):
        def on_validation_start(self):
            if self.trainer.sanity_checking:
                raise RuntimeError("Trouble!")

    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "sanity"), filename="exception", save_on_exception=True, save_top_k=-1
    )
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=1, num_sanity_val_steps=1))
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(RaisesInSanityCheck(), make_loader(n=64), make_loader(n=32, seed=1))
    assert not (tmp_path / "sanity" / "exception.ckpt").exists()

    # Before the first step: nothing to save, like ModelCheckpoint (its _last_global_step_saved starts at 0).
    sync = ModelCheckpoint(dirpath=tmp_path / "sync0", filename="exception", save_on_exception=True)
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "ours0"), filename="exception", save_on_exception=True, save_top_k=-1
    )
    trainer = pl.Trainer(callbacks=[sync, ours], **trainer_kwargs(max_epochs=1))
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(RaisesAtStep(0), make_loader(n=64), make_loader(n=32, seed=1))
    assert not (tmp_path / "sync0" / "exception.ckpt").exists()
    assert not (tmp_path / "ours0" / "exception.ckpt").exists()


# -- MisconfigurationException with ModelCheckpoint's wording ---------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "wording"),
    [
        ({"save_top_k": -3}, r"Invalid value for save_top_k=-3. Must be >= -1"),
        ({"every_n_epochs": -3}, r"Invalid value for every_n_epochs=-3. Must be >= 0"),
        ({"every_n_train_steps": -3}, r"Invalid value for every_n_train_steps=-3. Must be >= 0"),
        ({"mode": "unknown_option"}, r"`mode` can be min, max but got unknown_option"),
        ({"save_top_k": 3}, r"\(save_top_k=3, monitor=None\) is not a valid configuration. No quantity"),
    ],
)
def test_model_checkpoints_bad_values_raise_its_misconfiguration_exception_and_a_config_error(kwargs, wording):
    with pytest.raises(MisconfigurationException, match=wording):
        ModelCheckpoint(**kwargs)
    with pytest.raises(MisconfigurationException, match=wording) as info:
        AsyncCheckpointCallback(**kwargs)
    assert isinstance(info.value, ConfigError)
    assert next(iter(kwargs)) in str(info.value)  # names the parameter


def test_save_on_exception_and_save_top_k_zero_are_accepted_like_model_checkpoint():
    assert AsyncCheckpointCallback(save_on_exception=True).save_on_exception is True
    assert AsyncCheckpointCallback(save_top_k=0, monitor="val_loss").save_top_k == 0


# -- load_state_dict with a changed dirpath --------------------------------------------------------------------------
def test_load_state_dict_from_another_dirpath_restores_best_model_path_with_model_checkpoints_warning(tmp_path):
    state = {
        "monitor": None,
        "best_model_path": "epoch=10-step=1436.ckpt",
        "best_model_score": torch.tensor(2.246),
        "best_k_models": {"epoch=10-step=1436.ckpt": torch.tensor(2.246)},
        "kth_best_model_path": "epoch=10-step=1436.ckpt",
        "kth_value": torch.tensor(2.246),
        "last_model_path": "last2245.ckpt",
        "current_score": None,
        "dirpath": str(tmp_path / "before"),
    }
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "after"))
    with pytest.warns(UserWarning, match="The dirpath has changed from"):
        ours.load_state_dict(state)
    assert ours.best_model_path == "epoch=10-step=1436.ckpt"
    assert ours.best_k_models == {} and ours.last_model_path == "" and ours.kth_best_model_path == ""
    same = AsyncCheckpointCallback(dirpath=str(tmp_path / "before"))
    same.load_state_dict(state)
    assert same.last_model_path == "last2245.ckpt" and same.best_k_models == state["best_k_models"]


# -- pickling -------------------------------------------------------------------------------------------------------
def test_a_pickled_callback_equals_the_original_like_model_checkpoint(tmp_path):
    import pickle

    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_loss", save_top_k=2, every_n_train_steps=3)
    assert vars(pickle.loads(pickle.dumps(ours))) == vars(ours)
    other = AsyncCheckpointCallback(dirpath=str(tmp_path), monitor="val_loss", save_top_k=3, every_n_train_steps=3)
    assert vars(other) != vars(ours)


def test_an_empty_filename_is_model_checkpoints_default_name(tmp_path):
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", filename="", every_n_train_steps=4, save_top_k=-1)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), filename="", every_n_train_steps=4, save_top_k=-1)
    fit([sync, ours], max_steps=8)
    assert sorted(os.listdir(tmp_path / "sync")) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert [os.path.basename(p) for p in (ours.best_model_path,)] == ["epoch=0-step=8.ckpt"]
    assert {step: record["filename"] for step, record in committed(tmp_path / "async").items()} == {
        4: "epoch=0-step=4.ckpt",
        8: "epoch=0-step=8.ckpt",
    }
