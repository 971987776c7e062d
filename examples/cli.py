"""Train with LightningCLI; the checkpoint callback comes from YAML.

python examples/cli.py fit --config examples/async_checkpoint.yaml
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(pl.LightningModule):
    """A small MLP with BatchNorm and dropout."""

    def __init__(self, width: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 2)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class RandomData(pl.LightningDataModule):
    """Synthetic classification data."""

    def __init__(self, n: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=self.batch_size)


def main(args: list[str] | None = None) -> LightningCLI:
    """Run LightningCLI (``args`` overrides ``sys.argv`` for tests)."""
    return LightningCLI(TinyModel, RandomData, args=args)


if __name__ == "__main__":
    main()
