"""One rank of the DDP sliced-layout test: 2 CPU ranks (gloo), real Lightning ``DDPStrategy``.

Usage: ``python _lightning_sliced_worker.py <out>`` under ``tests.helpers.dist.launch_ranks``; prints ``RESULT {json}``.

1. One fit (BatchNorm, dropout, Adam, a step scheduler; 4 steps) with two callbacks cutting at the same steps:
   the single-writer layout into ``<out>/single`` and ``ddp_layout="sliced"`` into ``<out>/sliced``.
2. Two fresh models resume to step 6, one from ``latest_checkpoint(<out>/sliced)`` (a DCP folder, loaded by the
   DDP strategy's checkpoint IO), one from ``latest_checkpoint(<out>/single)`` (each with a single-layout callback in the Trainer); their losses and final weights
   are recorded for comparison.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback, latest_checkpoint  # noqa: E402
from tests.helpers.models import BNDropoutModel, make_loader  # noqa: E402


class Recording(BNDropoutModel):
    """Also rank-divergent state that DDP does not synchronize: frozen parameters updated from each rank's own batch
    (a running statistic kept as ``requires_grad=False`` parameters), which must come from rank 0 in the sliced
    layout as in the single-writer checkpoint (several sizes, so DCP's size balancing would hand some to rank 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.seen = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(n), requires_grad=False) for n in (8, 300, 5000, 70_000)]
        )

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            for p in self.seen:
                p.add_(batch[0].sum())  # this rank's batch only
        self.losses.append(loss.item())
        return loss


def fit(model: pl.LightningModule, callbacks: list, max_steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
    )
    pl.seed_everything(3)
    trainer.fit(model, make_loader(n=64), ckpt_path=ckpt_path)
    return trainer


def main(out: str) -> None:
    single = AsyncCheckpointCallback(dirpath=f"{out}/single", every_n_train_steps=2, save_top_k=-1)
    sliced = AsyncCheckpointCallback(dirpath=f"{out}/sliced", every_n_train_steps=2, ddp_layout="sliced", save_top_k=-1)
    trainer = fit(Recording(), [single, sliced], max_steps=4)
    result: dict = {"rank": trainer.global_rank}
    result["sliced_latest"] = latest_checkpoint(f"{out}/sliced")
    result["single_latest"] = latest_checkpoint(f"{out}/single")
    for name in ("sliced", "single"):
        model = Recording()
        # The callback in the Trainer gives the DDP strategy's checkpoint IO the DCP-folder loader (any layout).
        resumed = AsyncCheckpointCallback(
            dirpath=f"{out}/r-{name}", every_n_train_steps=100, save_on_train_end=False, save_top_k=-1
        )
        fit(model, [resumed], max_steps=6, ckpt_path=result[f"{name}_latest"])
        result[f"{name}_losses"] = model.losses
        if trainer.global_rank == 0:
            torch.save(model.state_dict(), f"{out}/resumed-{name}.pt")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
