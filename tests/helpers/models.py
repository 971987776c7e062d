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


ROWS, DIM = 65_536, 64  # 16 MB of float32


class _RenormsOwnWeight(nn.Module):
    """Unknown to the proof: writes its own weight in forward through a tensor operation (bumps ``_version``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(ROWS, DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            rows = self.weight[idx].renorm(2, 0, 1.0)
            self.weight.index_copy_(0, idx, rows)
        return self.weight[idx]


class TableModel(pl.LightningModule):
    """An embedding table whose forward writes the rows it looks up, plus a small head (SGD: no optimizer state)."""

    def __init__(self, kind: str = "embedding") -> None:
        super().__init__()
        if kind == "embedding":
            self.table: nn.Module = nn.Embedding(ROWS, DIM, max_norm=1.0)
        elif kind == "embedding_plain":
            self.table = nn.Embedding(ROWS, DIM)
        elif kind == "bag":
            self.table = nn.EmbeddingBag(ROWS, DIM, max_norm=1.0, mode="sum")
        else:
            self.table = _RenormsOwnWeight()
        self.kind = kind
        self.head = nn.Linear(DIM, 2)
        self.register_buffer("seen", torch.zeros(ROWS))  # a running count per row, for batch-transfer hooks

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.kind == "bag":
            return self.head(self.table(idx.view(-1, 1)))
        return self.head(self.table(idx))

    def training_step(self, batch, batch_idx):
        idx, y = batch
        return nn.functional.cross_entropy(self(idx), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def table_loader(n: int = 96, batch_size: int = 8) -> DataLoader:
    """Indices of a few rows at the end of the table, with labels (not shuffled)."""
    g = torch.Generator().manual_seed(0)
    # A few rows at the end of the table, looked up again and again: the optimizer pushes their norm over max_norm
    # and the next forward renormalizes them while the copy is still on its way there.
    idx = ROWS - 1 - torch.randint(0, 32, (n,), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return DataLoader(TensorDataset(idx, y), batch_size=batch_size, shuffle=False)


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


_RECORDS_ITS_FILE = ("best_model_path", "best_model_score", "best_k_models", "kth_best_model_path", "kth_value")
_RECORDS_ITS_FILE += ("current_score", "last_model_path")


def without_model_checkpoint_state(ckpt: dict) -> dict:
    """Drop ModelCheckpoint's own callback entry and the same entries of AsyncCheckpointCallback's (rng states and
    run id stay): each records the file it is writing, so they differ by design between two callbacks' files."""
    ckpt = dict(ckpt)
    callbacks = {}
    for key, state in ckpt["callbacks"].items():
        if key.startswith("ModelCheckpoint"):
            continue
        if key.startswith("AsyncCheckpointCallback") and isinstance(state, dict):
            state = {k: v for k, v in state.items() if k not in _RECORDS_ITS_FILE}
        callbacks[key] = state
    ckpt["callbacks"] = callbacks
    return ckpt


def fit_compare_every_step(
    tmp_path, model: pl.LightningModule, train_data=None, *, max_steps: int = 10, callbacks=(), **fit_kwargs
):
    """Train with AsyncCheckpointCallback and a synchronous ModelCheckpoint, both every step; compare every commit.

    The synchronous save runs first in each batch end, so nothing delays the next forward after our cut (the
    background copy overlaps it). ``fit_kwargs`` go to ``Trainer`` except ``datamodule``/``val_data``.
    Returns the store of our checkpoints.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore

    datamodule = fit_kwargs.pop("datamodule", None)
    val_data = fit_kwargs.pop("val_data", None)
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"), every_n_train_steps=1, save_on_train_end=False, save_top_k=-1
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    pl.seed_everything(3)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[*callbacks, sync, ours], **trainer_kwargs(**fit_kwargs))
    if datamodule is not None:
        trainer.fit(model, datamodule=datamodule)
    else:
        trainer.fit(model, train_data, val_data)
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    for gen in store.generations():
        theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={gen.step}.ckpt")))
        mine = without_model_checkpoint_state(load_checkpoint(store.object_url(gen.step, "checkpoint.ckpt")))
        assert_same(theirs, mine, f"step{gen.step}")
    return store
