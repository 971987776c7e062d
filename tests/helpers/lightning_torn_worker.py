"""One rank of the sharded-path guard test: 2 CPU ranks (gloo), Lightning ``DDPStrategy``, ``ddp_layout="sliced"``.

Usage: ``python _lightning_torn_worker.py <out>`` under ``tests.helpers.dist.launch_ranks``; prints ``RESULT {json}``.

The training step resets a padding row through ``.data`` (no version bump) while the rank's staging thread is held
(``threading.Event``) until that write ran: the deferred copy sees the written row, the exact guard refuses the save
on both ranks. The fit must go on and retake the checkpoint (as the single-writer engine does), never crash and
never commit the written row; a synchronous ``ModelCheckpoint`` writes every step beside it for comparison.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402

ROWS, DIM, PAD = 16_384, 64, 16_383


class Hold(pl.Callback):
    """Holds this rank's staging thread after each cut until the model's write (or the last step)."""

    lightning_async_ckpt_read_only = True

    def __init__(self, ours: AsyncCheckpointCallback) -> None:
        self.ours = ours
        self.gate = threading.Event()
        self.gate.set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step < trainer.max_steps:  # this rank's next staging waits for the model's write
            self.gate = gate = threading.Event()
            self.ours.checkpointer.stage_worker.submit(lambda: gate.wait(120))

    def on_train_end(self, trainer, pl_module):
        self.gate.set()


class Padded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 2)
        self.hold: Hold | None = None

    def training_step(self, batch, batch_idx):
        self.emb.weight.data[PAD].zero_()
        if self.hold is not None:
            self.hold.gate.set()
        idx, y = batch
        return nn.functional.cross_entropy(self.head(self.emb(idx)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main(out: str) -> None:
    g = torch.Generator().manual_seed(0)
    idx = torch.cat([torch.full((8,), PAD), ROWS - 2 - torch.randint(0, 16, (56,), generator=g)])
    data = DataLoader(TensorDataset(idx, torch.randint(0, 2, (64,), generator=g)), batch_size=4, shuffle=False)
    ours = AsyncCheckpointCallback(
        dirpath=f"{out}/sliced", every_n_train_steps=1, ddp_layout="sliced", save_on_train_end=False
    )
    sync = ModelCheckpoint(dirpath=f"{out}/sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    hold = Hold(ours)
    model = Padded()
    model.hold = hold
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=5,
        callbacks=[hold, sync, ours],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data)
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "committed_step": ours.committed_step}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
