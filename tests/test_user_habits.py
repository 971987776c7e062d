"""Issue 23: habits ModelCheckpoint users bring (round 3) — the last word, ``last``, arguments, metrics.

Real Trainers, real loggers and real fsspec filesystems; S3 through the moto server of ``conftest.py``.
"""

from __future__ import annotations

import csv
import inspect
import logging

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_async_ckpt import AsyncCheckpointCallback
from tests._lightning_models import BNDropoutModel, make_loader, trainer_kwargs


def _csv_column(logger: CSVLogger, name: str) -> list[float]:
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def test_the_last_logged_committed_step_is_the_final_one(tmp_path, caplog):
    pl.seed_everything(0)
    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    logger = CSVLogger(tmp_path / "logs")
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_steps=16, logger=logger, log_every_n_steps=1))
    with caplog.at_level(logging.INFO, logger="lightning_async_ckpt"):
        trainer.fit(BNDropoutModel(), make_loader())
    assert cb.committed_step == 16
    assert _csv_column(logger, "ckpt/committed_step")[-1] == 16
    assert int(trainer.progress_bar_metrics["ckpt/committed_step"]) == 16
    assert any("final committed checkpoint step 16" in r.getMessage() for r in caplog.records)


def test_log_metrics_false_logs_no_ckpt_metric(tmp_path):
    pl.seed_everything(0)
    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2, log_metrics=False)
    logger = CSVLogger(tmp_path / "logs")
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_steps=6, logger=logger, log_every_n_steps=1))
    trainer.fit(BNDropoutModel(), make_loader())
    assert cb.committed_step == 6
    assert not [k for k in trainer.logged_metrics if k.startswith("ckpt/")]
    assert "ckpt/committed_step" not in trainer.progress_bar_metrics


def test_model_checkpoint_arguments_keep_its_positional_order():
    theirs = list(inspect.signature(ModelCheckpoint.__init__).parameters)[1:]
    params = inspect.signature(AsyncCheckpointCallback.__init__).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
    assert positional == theirs
    # Every argument of the library's own is keyword-only.
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} >= {"keep_last", "storage_options", "ddp_layout"}
    cb = AsyncCheckpointCallback("d", None, None, True)  # meant as verbose=True, as with ModelCheckpoint
    assert cb.verbose is True and cb.save_on_train_end is True
    with pytest.raises(TypeError):
        AsyncCheckpointCallback(
            "d", None, None, True, None, None, False, False, "min", True, 2, None, None, None, True, 3
        )
