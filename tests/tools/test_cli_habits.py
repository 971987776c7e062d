"""Issue 39, point 11: the command line on a folder of ``ModelCheckpoint`` files names them."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt.tools.cli import main
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


@pytest.fixture(scope="module")
def model_checkpoint_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mc") / "checkpoints"
    callback = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(max_steps=4, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader())
    return folder


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_ls_and_verify_name_the_model_checkpoint_files_they_found(model_checkpoint_dir, command, capsys):
    rc = main([command, str(model_checkpoint_dir)])
    err = capsys.readouterr().err
    names = sorted(p.name for p in model_checkpoint_dir.glob("*.ckpt"))
    assert names and "last.ckpt" in names
    assert all(name in err for name in names), err
    assert "ModelCheckpoint" in err
    assert rc == (0 if command == "ls" else 2)
