"""Lightning sharded two tiers: the fits and checks of one rank, ``ModelParallelStrategy`` (FSDP2) or sliced DDP.

The two-tier part of ``tests/helpers/lightning_sharded_tiers_replicas_worker.py`` (``run_tiers``), which launches
it; the kind is ``sys.argv[2]`` of that launch. Each rank has its own node-local folder ``<out>/node<r>`` (as on two
nodes). ``kind``: ``mp`` (``ModelParallelStrategy``, FSDP2) or ``sliced`` (``DDPStrategy`` with
``ddp_layout="sliced"``, BatchNorm, dropout).

1. ``reference`` (run by the launching worker, shared with the replica part): 12 steps without checkpoints; the full
   weights at step 12 are recorded (rank 0 holds them).
2. ``first``: 8 steps (``ckpt_path="last"`` with both tiers empty: a fresh start) with ``AsyncCheckpointCallback(dirpath=<out>/durable, every_n_train_steps=4,
   local_dirpath=<out>/node<r>, local_every_n_train_steps=2, local_keep_last=2)``; both tiers are copied to
   ``<out>/lost`` and rank 1's local folder there is deleted.
3. ``local``: a fresh model with ``ckpt_path="last"``: every rank resumes step 8 from its own local folder, trains to 12.
4. ``durable``: the same in ``<out>/lost``: both ranks resume step 8 from the durable tier, train to 12.
5. ``emergency``: rank 1 alone receives a real SIGUSR1 at step 5: the emergency cut is committed to both ranks'
   local tiers and promoted within ``preemption_grace_s``; training stops.

``sliced`` has dropout, whose random state Lightning does not restore: its resumed fits are compared with each other
(local against durable), not with the uninterrupted one.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from tests.helpers.lightning_sharded_worker import ShardedModel, loader  # noqa: E402
from tests.helpers.models import BNDropoutModel, make_loader  # noqa: E402

KIND = sys.argv[2] if len(sys.argv) > 2 else "mp"


class SlicedModel(BNDropoutModel):
    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step


def _full(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    if KIND == "sliced":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class Record(pl.Callback):
    """The full weights at the given steps (a collective on every rank)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.weights = steps, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.weights[trainer.global_step] = _full(pl_module)


class Signal(pl.Callback):
    """Rank 1 sends itself SIGUSR1 at the end of step 5 (before the checkpoint callback's hook of that batch)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.rank == 1 and trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGUSR1)


def _fit(callbacks: list, max_steps: int, ckpt_path: str | None = None) -> tuple[pl.LightningModule, pl.Trainer]:
    sliced = KIND == "sliced"
    model = SlicedModel() if sliced else ShardedModel("plain")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp" if sliced else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        # A fit without the library's callback (the reference) must not get Lightning's default ModelCheckpoint,
        # which would write into the working directory (the checkout).
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    pl.seed_everything(7)
    trainer.fit(model, make_loader(n=64) if sliced else loader(), ckpt_path=ckpt_path)
    return model, trainer


def _callback(out: str, rank: int) -> AsyncCheckpointCallback:
    return AsyncCheckpointCallback(
        dirpath=f"{out}/durable",
        every_n_train_steps=4,
        save_top_k=-1,
        local_dirpath=f"{out}/node{rank}",
        local_every_n_train_steps=2,
        local_keep_last=2,
        ddp_layout="sliced" if KIND == "sliced" else "single",
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def run_tiers(out: str, record: Record) -> dict:
    """Steps 2-5 above in ``out``; ``record`` holds the reference fit's full weights at step 12."""
    rank = dist.get_rank()
    result: dict = {"rank": rank, "kind": KIND}

    first, _ = _fit([_callback(out, rank)], 8, ckpt_path="last")  # nothing on either tier yet: a fresh start
    result["first_start"] = first.start_step
    local_store = CheckpointStore(f"{out}/node{rank}/rank-{rank}", check_writable=False)
    result["first_local"] = [g.step for g in local_store.generations()]
    result["first_durable"] = [g.step for g in CheckpointStore(f"{out}/durable", check_writable=False).generations()]
    result["first_local_meta"] = "meta.pt" in {o.name for o in local_store.manifest(8).objects}
    # A copy of both tiers for the fallback fit (rank 1 then loses its local folder there).
    shutil.copytree(f"{out}/node{rank}", f"{out}/lost/node{rank}")
    if rank == 0:
        shutil.copytree(f"{out}/durable", f"{out}/lost/durable")
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{out}/lost/node1")
    dist.barrier()

    model, trainer = _fit([_callback(out, rank)], 12, ckpt_path="last")
    result.update(local_start=model.start_step, local_path=str(trainer.ckpt_path))
    weights = _full(model)  # a collective; rank 0 holds the full weights
    result["local_vs_reference_12"] = _same(weights, record.weights[12]) if rank == 0 else None

    model, trainer = _fit([_callback(f"{out}/lost", rank)], 12, ckpt_path="last")
    result.update(durable_start=model.start_step, durable_path=str(trainer.ckpt_path))
    local_weights, weights = weights, _full(model)
    result["durable_vs_reference_12"] = _same(weights, record.weights[12]) if rank == 0 else None
    result["durable_vs_local_12"] = _same(weights, local_weights) if rank == 0 else None
    result["last_durable"] = [
        g.step for g in CheckpointStore(f"{out}/lost/durable", check_writable=False).generations()
    ]
    # Emergency save: rank 1 alone receives a real SIGUSR1 at step 5; the cut lands in both tiers, training stops.
    emergency = AsyncCheckpointCallback(
        dirpath=f"{out}/emerg/durable",
        every_n_train_steps=100,
        local_dirpath=f"{out}/emerg/node{rank}",
        local_every_n_train_steps=100,
        preemption_signal=signal.SIGUSR1,
        preemption_grace_s=120,
        ddp_layout="sliced" if KIND == "sliced" else "single",
    )
    _, trainer = _fit([Signal(rank), emergency], 12)
    result["emergency_stop"] = trainer.global_step
    local = CheckpointStore(f"{out}/emerg/node{rank}/rank-{rank}", check_writable=False)
    result["emergency_local"] = [g.step for g in local.generations()]
    result["emergency_durable"] = [
        g.step for g in CheckpointStore(f"{out}/emerg/durable", check_writable=False).generations()
    ]
    return result
