"""One rank of a two-process DDP run with ``monitor``/``save_top_k``, launched by tests/lightning/test_modelcheckpoint_ddp.py.

Usage: python _modelcheckpoint_ddp_worker.py DIRPATH. Prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import re
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from tests.helpers.models import make_loader  # noqa: E402
from tests.helpers.selection import ValModel  # noqa: E402


class SyncedValModel(ValModel):
    """``val_loss`` reduced across ranks (``sync_dist``), as a DDP user monitors it."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)


def _steps(paths) -> list[int]:
    return sorted(int(re.search(r"step[-=]0*(\d+)", p).group(1)) for p in paths)


def main() -> None:
    dirpath = sys.argv[1]
    pl.seed_everything(3)
    args = dict(monitor="val_loss", save_top_k=2, filename="{epoch}-{step}")
    sync = ModelCheckpoint(dirpath=os.path.join(dirpath, "sync"), **args)
    ours = AsyncCheckpointCallback(dirpath=os.path.join(dirpath, "async"), save_on_train_end=False, **args)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        max_epochs=4,
        callbacks=[ours, sync],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(SyncedValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    result = {
        "rank": trainer.global_rank,
        "checkpoint_callback_is_sync": trainer.checkpoint_callback is sync,
        "ours_best_k": _steps(ours.best_k_models),
        "ours_best": _steps([ours.best_model_path]),
        "sync_best_k": _steps(sync.best_k_models),
        "sync_best": _steps([sync.best_model_path]),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
