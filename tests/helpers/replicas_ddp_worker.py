"""One rank of a DDP run on CPU where every rank is its own "node" with its own local folder, with peer replicas.

Launched by tests/lightning/test_replicas_ddp.py. Usage: python replicas_ddp_worker.py BASE PHASE REPLICAS
    PHASE: ``train`` (steps 1..6), ``resume`` (``ckpt_path="last"``, to step 10) or ``uninterrupted`` (1..10).
Every epoch is 2 steps (16 samples per rank, batch 8), so each local cut (every 2 steps) ends an epoch. ``dirpath`` is
the ``faulty://`` wrapper of ``BASE/durable``; in ``resume`` every read of the bytes of its step-4 checkpoint (the
one a fall-back to ``dirpath`` would load) fails, persistently.
Writes ``BASE/final-rank<R>.pt`` (the model's final state) and prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from lightning_async_ckpt.testing import (
    Fault,  # noqa: E402
    register_faulty,
)
from tests.helpers.models import BNDropoutModel, make_loader  # noqa: E402

register_faulty()  # this process names faulty:// URLs


def main() -> None:
    base, phase, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank))  # one process per "node"
    pl.seed_everything(3)
    faults = [Fault(op="read", path="step=4.ckpt", times=None, error="oserror")] if phase == "resume" else []
    callback = AsyncCheckpointCallback(
        dirpath=f"faulty://{base}/durable",
        storage_options={"target_protocol": "file", "faults": faults},
        every_n_train_steps=4,
        local_dirpath=f"{base}/local-rank{rank}",
        local_every_n_train_steps=2,
        replicas=replicas,
        save_on_train_end=False,
        restore_rng=True,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy="ddp",
        max_steps=6 if phase == "train" else 10,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    model = BNDropoutModel()
    trainer.fit(model, make_loader(n=16 * world, batch_size=8), ckpt_path="last" if phase == "resume" else None)
    torch.save(model.state_dict(), f"{base}/final-rank{rank}.pt")
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "ckpt_path": str(trainer.ckpt_path)}), flush=True)


if __name__ == "__main__":
    main()
