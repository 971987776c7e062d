"""Shared pieces of the ModelCheckpoint selection tests: a model with a validation metric and name parsers."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import torch

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.lightning.selection import EXTRA_KEY
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

__all__ = ["ValModel", "committed", "fit", "step_of", "step_of_file"]


class ValModel(BNDropoutModel):
    """Logs ``val_loss`` (and ``val_acc``) from a validation loop."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())


def committed(path) -> dict[int, dict]:
    """Committed generations of a store: step -> the callback's manifest record."""
    store = CheckpointStore(str(path), check_writable=False)
    return {g.step: g.manifest.extra[EXTRA_KEY] for g in store.generations()}


def step_of(path: str) -> int:
    return int(re.search(r"step-0*(\d+)", path).group(1))


def step_of_file(path: str) -> int:
    return int(re.search(r"step=(\d+)", path).group(1))


def fit(callbacks, *, seed=3, n=64, ckpt_path=None, **trainer_args):
    pl.seed_everything(seed)
    model = ValModel()
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(**trainer_args))
    trainer.fit(model, make_loader(n=n), make_loader(n=32, seed=1), ckpt_path=ckpt_path)  # 8 batches per epoch
    return trainer, model
