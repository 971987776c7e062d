"""One rank of the Lightning sharded tests: ``ModelParallelStrategy`` (FSDP2 ``fully_shard``) on 2 CPU ranks (gloo).

Usage: ``python _lightning_sharded_worker.py <out>`` under ``tests.helpers.dist.launch_ranks``; prints ``RESULT {json}``.

One launch runs every fit (each 2-process Lightning start costs seconds):

1. ``plain`` (no BatchNorm), 8 steps (4 per epoch), ``AsyncCheckpointCallback`` into ``<out>/ours`` and Lightning's
   synchronous ``ModelCheckpoint`` into ``<out>/sync``, both every 4 steps: the uninterrupted run (its losses and
   final full weights are recorded).
2. ``bn`` (BatchNorm and dropout), 4 steps, both callbacks every 2 steps into ``<out>/bn-ours``, ``<out>/bn-sync``.
3. Resume: ``<out>/ours``'s step-4 generation is copied into ``<out>/half``; a fresh model resumes from
   ``latest_checkpoint(<out>/half)`` (the step-4 folder) to step 8, and another fresh model with
   ``ckpt_path="last"`` (the callback finds step 8 of the resumed run) continues to step 10.
4. Rank 1's storage fails at the second save (a ``faulty://`` store): the fit must end with an error on both ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback, latest_checkpoint  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import (
    Fault,  # noqa: E402
    register_faulty,
)

register_faulty()  # this process names faulty:// URLs


def make_net(kind: str) -> nn.Sequential:
    """The network of each model kind (also built unsharded by the test for loading)."""
    if kind == "bn":
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


class ShardedModel(pl.LightningModule):
    """FSDP2 ``fully_shard`` per Linear and at the root, Adam and a step-interval LR scheduler."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = make_net(kind)
        self.losses: list[float] = []
        self.start_step: int | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # 4 batches per rank and epoch


def fit(model: ShardedModel, callbacks: list, max_steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    pl.seed_everything(7)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


def full_weights(model: ShardedModel) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(out: str) -> None:
    result: dict = {}
    plain = ShardedModel("plain")
    ours = AsyncCheckpointCallback(dirpath=f"{out}/ours", every_n_train_steps=4, save_top_k=-1)
    fit(
        plain,
        [
            ours,
            ModelCheckpoint(dirpath=f"{out}/sync", filename="{step}", every_n_train_steps=4, save_top_k=-1),
        ],
        max_steps=8,
    )
    rank = dist.get_rank()
    result.update(rank=rank, losses=plain.losses, latest=latest_checkpoint(f"{out}/ours"))
    # Staged behind the fences, not at the cut (over every save of the fit).
    result["deferred_bytes"] = sum(r.deferred_bytes for r in ours.checkpointer.records)
    weights = full_weights(plain)
    if rank == 0:
        torch.save(weights, f"{out}/uninterrupted.pt")
        store = CheckpointStore(f"{out}/ours", check_writable=False)
        shutil.copytree(store.url(4), f"{out}/half/{os.path.basename(store.url(4))}")
    dist.barrier()

    bn_ours = AsyncCheckpointCallback(dirpath=f"{out}/bn-ours", every_n_train_steps=2, save_top_k=-1)
    fit(
        ShardedModel("bn"),
        [
            bn_ours,
            ModelCheckpoint(dirpath=f"{out}/bn-sync", filename="{step}", every_n_train_steps=2, save_top_k=-1),
        ],
        max_steps=4,
    )

    result["bn_deferred_bytes"] = sum(r.deferred_bytes for r in bn_ours.checkpointer.records)
    result["half_latest"] = latest_checkpoint(f"{out}/half")
    resumed = ShardedModel("plain")
    fit(
        resumed,
        [AsyncCheckpointCallback(dirpath=f"{out}/half", every_n_train_steps=4, save_top_k=-1)],
        max_steps=8,
        ckpt_path=result["half_latest"],
    )
    result.update(resumed_start=resumed.start_step, resumed_losses=resumed.losses)
    resumed_weights = full_weights(resumed)
    result["resumed_equal"] = all(torch.equal(weights[k], resumed_weights[k]) for k in weights)

    last = ShardedModel("plain")
    fit(
        last,
        [AsyncCheckpointCallback(dirpath=f"{out}/half", every_n_train_steps=4, save_top_k=-1)],
        max_steps=10,
        ckpt_path="last",
    )
    result.update(last_start=last.start_step, last_steps=len(last.losses))

    # Last (it ends the fit with an error): rank 1's data file fails to open at the second save (step 4).
    faults = [Fault(op="open", path="__1_0.distcp", at=2, error="oserror")]
    faulty = AsyncCheckpointCallback(
        dirpath=f"faulty://{out}/faulty",
        storage_options={"target_protocol": "file", "faults": faults},
        every_n_train_steps=2,
        retries=0,
        save_top_k=-1,
    )
    try:
        fit(ShardedModel("plain"), [faulty], max_steps=8)
        result["fault"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["fault"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
