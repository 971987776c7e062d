"""The main job: train a small model on CPU with asynchronous checkpoints, then print what was committed.

    python examples/train_lightning.py --dirpath runs/demo

Every generation listed at the end is recoverable: its manifest was written after its data was durable.
Resume with ``trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))``.
"""

from __future__ import annotations

import argparse
import shutil
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint


class Classifier(pl.LightningModule):
    """An MLP with BatchNorm and dropout, trained with Adam and a step-interval LR schedule."""

    def __init__(self, width: int = 512, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(32, width)]
        for _ in range(depth):
            layers += [nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, width)]
        layers += [nn.ReLU(), nn.Linear(width, 10)]
        self.net = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=200, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="runs/demo")
    parser.add_argument("--seconds", type=float, default=60.0, help="approximate training time")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N optimizer steps")
    parser.add_argument("--keep-last", type=int, default=3)
    args = parser.parse_args()

    shutil.rmtree(args.dirpath, ignore_errors=True)  # the demo starts fresh; committed data elsewhere is untouched
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(8192, 32), torch.randint(0, 10, (8192,)))
    loader = DataLoader(data, batch_size=64, shuffle=True)
    ckpt = AsyncCheckpointCallback(dirpath=args.dirpath, every_n_train_steps=args.every, keep_last=args.keep_last)
    trainer = pl.Trainer(
        max_time={"seconds": args.seconds},
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(Classifier(), loader)
    elapsed = time.perf_counter() - t0

    store = CheckpointStore(args.dirpath, check_writable=False)
    print(f"\ntrained {trainer.global_step} steps in {elapsed:.1f}s; committed generations in {args.dirpath}:")
    for gen in store.generations():
        m = gen.manifest
        print(f"  step {gen.step:>6}  {m.total_bytes / 1e6:8.2f} MB  run {m.run_id}  {gen.path}")
    records = list(ckpt.checkpointer.records)
    blocked = [r.blocked_s * 1e3 for r in records if r.outcome == "committed"]
    print(
        f"requested step {ckpt.requested_step}, committed step {ckpt.committed_step} "
        f"({sum(r.outcome == 'committed' for r in records)} committed, {ckpt.skipped} skipped)"
    )
    if blocked:
        print(
            f"training-thread blocking per checkpoint: median {sorted(blocked)[len(blocked) // 2]:.2f} ms, "
            f"max {max(blocked):.2f} ms over {len(blocked)} checkpoints"
        )
    print(f"resume with: trainer.fit(model, ckpt_path={latest_checkpoint(args.dirpath)!r})")


if __name__ == "__main__":
    main()
