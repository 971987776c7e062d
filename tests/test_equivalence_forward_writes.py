"""Class A/C of issue 12: parameters written in place during forward, compared bit for bit with ModelCheckpoint.

The table is large (16 MB) and the looked-up rows sit at its end, so the background copy of the table is still
running when the next forward renormalizes those rows: a deferral behind the optimizer-step fence would tear.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests._lightning_models import assert_same, load_checkpoint, trainer_kwargs, without_model_checkpoint_state

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
    g = torch.Generator().manual_seed(0)
    # A few rows at the end of the table, looked up again and again: the optimizer pushes their norm over max_norm
    # and the next forward renormalizes them while the copy is still on its way there.
    idx = ROWS - 1 - torch.randint(0, 32, (n,), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return DataLoader(TensorDataset(idx, y), batch_size=batch_size, shuffle=False)


def fit_and_compare(tmp_path, kind: str, *, max_steps: int = 10, **ours_kwargs) -> CheckpointStore:
    """Train with ours (every step) beside a synchronous ModelCheckpoint (every step); compare every commit."""
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"), every_n_train_steps=1, save_on_train_end=False, **ours_kwargs
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    pl.seed_everything(3)
    # The synchronous save runs first, so nothing delays the next forward after our cut.
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[sync, ours], **trainer_kwargs())
    trainer.fit(TableModel(kind), table_loader())
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    for gen in store.generations():
        theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={gen.step}.ckpt")))
        mine = without_model_checkpoint_state(load_checkpoint(store.url(gen.step, "checkpoint.ckpt")))
        assert_same(theirs, mine, f"step{gen.step}")
    return store


@pytest.mark.parametrize("kind", ["embedding", "bag"])
def test_max_norm_tables_are_copied_at_the_cut_and_match_model_checkpoint(tmp_path, kind):
    store = fit_and_compare(tmp_path, kind)
    assert [g.step for g in store.generations()] == list(range(1, 11))
    rows = store.manifest(10).plan["rows"]
    table = [r for r in rows if r["category"] == "parameter" and r["fence"] == "cut"]
    assert table and "max_norm" in table[0]["rule"]


class _TrustedButWrites(Checkpoint):
    """A ``Checkpoint`` subclass (trusted read-only by the proof) that renormalizes the table right after our cut.

    Lightning orders checkpoint callbacks last, keeping their order, so this hook runs right after the cut while the
    background copy of the 16 MB table is still running: only the runtime guard can catch it.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            w = pl_module.table.weight
            w[-64:] = w[-64:].renorm(2, 0, 0.5)  # an in-place write through a tensor operation (bumps _version)


def test_a_write_the_proof_cannot_see_is_refused_retaken_and_demoted(tmp_path):
    # Repeated: 8 cuts per run, 2 runs. Every commit equals the synchronous checkpoint; every refused cut is retaken
    # at the next batch end, and the demoted category is named in the manifest's plan.
    for run in range(2):
        root = tmp_path / str(run)
        ours = AsyncCheckpointCallback(dirpath=str(root / "async"), every_n_train_steps=2, save_on_train_end=False)
        sync = ModelCheckpoint(dirpath=root / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
        pl.seed_everything(3)
        trainer = pl.Trainer(max_steps=16, callbacks=[sync, ours, _TrustedButWrites()], **trainer_kwargs())
        trainer.fit(TableModel("embedding_plain"), table_loader(n=160))
        store = CheckpointStore(str(root / "async"), check_writable=False)
        steps = [g.step for g in store.generations()]
        for step in steps:
            theirs = without_model_checkpoint_state(load_checkpoint(str(root / "sync" / f"step={step}.ckpt")))
            mine = without_model_checkpoint_state(load_checkpoint(store.url(step, "checkpoint.ckpt")))
            assert_same(theirs, mine, f"run{run}.step{step}")
        outcomes = {r.requested_step: r.outcome for r in ours.checkpointer.records}
        torn = sorted(s for s, o in outcomes.items() if o == "torn")
        assert torn, "the write right after the cut overlapped no copy: the test did not exercise the guard"
        for step in torn:
            assert step + 1 in steps, f"torn cut {step} was not retaken at the next batch end ({steps})"
        rows = store.manifest(steps[-1]).plan["rows"]
        assert any(r["category"] == "parameter" and "guard" in r["rule"] for r in rows)
