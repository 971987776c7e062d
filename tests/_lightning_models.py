"""Small deterministic Lightning models shared by the Lightning tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class BNDropoutModel(pl.LightningModule):
    """BatchNorm, dropout, Adam and a step-interval LR scheduler: every state category in one model."""

    def __init__(self, width: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 2)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_loader(n: int = 128, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(
        TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def trainer_kwargs(**overrides) -> dict:
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


def assert_same(a, b, path: str = "") -> None:
    """Recursive equality of checkpoint contents: tensors bitwise, containers by keys and order."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.cpu(), b.cpu()), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: dict vs {type(b)}"
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a.keys())} vs {list(b.keys())}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)}[{len(a)}] vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def load_checkpoint(path: str, storage_options: dict | None = None) -> dict:
    """Load a checkpoint file (local path or fsspec URL) on the CPU."""
    import fsspec

    with fsspec.open(path, "rb", **(storage_options or {})) as f:
        return torch.load(f, map_location="cpu", weights_only=False)


def without_model_checkpoint_state(ckpt: dict) -> dict:
    """Drop ModelCheckpoint's own callback entry, which records the file it is writing and so differs by design."""
    ckpt = dict(ckpt)
    ckpt["callbacks"] = {k: v for k, v in ckpt["callbacks"].items() if not k.startswith("ModelCheckpoint")}
    return ckpt
