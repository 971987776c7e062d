"""GPU equivalence: on CUDA, every committed generation equals ModelCheckpoint at the same step, bit for bit.

Skipped without a CUDA device (CI has none); ``benchmarks/gpu_check.sh`` runs it on a GPU machine.
"""

from __future__ import annotations

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests.helpers.models import (
    BNDropoutModel,
    assert_same,
    make_loader,
    trainer_kwargs,
    without_model_checkpoint_state,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _load(path: str) -> dict:
    with fsspec.open(path, "rb") as f:
        ckpt = torch.load(f, map_location="cpu", weights_only=False)
    # Both checkpoint callbacks record the file being written in their state; every other entry must be identical.
    return without_model_checkpoint_state(ckpt)


class _WideModel(BNDropoutModel):
    def __init__(self) -> None:
        super().__init__(width=2048)
        self.net.insert(3, torch.nn.Linear(2048, 2048))


@pytest.mark.parametrize("defer", [True, False])
def test_every_committed_generation_on_cuda_equals_model_checkpoint(tmp_path, defer):
    pl.seed_everything(7)
    # Wide enough (about 40 MB of parameters and Adam state) that the background copy overlaps the next step.
    model = _WideModel()
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"), every_n_train_steps=2, save_top_k=-1, save_on_train_end=False, defer=defer
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        max_steps=12,
        accumulate_grad_batches=1,
        callbacks=[ours, sync],
        **trainer_kwargs(accelerator="cuda", deterministic=False),
    )
    trainer.fit(model, make_loader())

    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    steps = [g.step for g in store.generations()]
    assert steps == [2, 4, 6, 8, 10, 12]
    for step in steps:
        theirs = _load(str(tmp_path / "sync" / f"step={step}.ckpt"))
        mine = _load(store.object_url(step, "checkpoint.ckpt"))
        assert mine["global_step"] == step
        assert_same(theirs, mine, f"step{step}")
