"""One rank of a two-process DDP run with a local tier, launched by tests/lightning/test_tiers_ddp.py.

Usage: python tiers_ddp_worker.py BASE LAYOUT PHASE
    LAYOUT: ``shared`` (both ranks on one node: one local folder) or ``per_rank`` (two nodes of one rank each, with
    their own "node-local" folder; rank 0 writes, so rank 1's stays empty). PHASE: ``train`` (steps 1..6) or ``resume`` (``"last"`` to 8).
Prints one line ``RESULT {json}`` on success.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from tests.helpers.models import BNDropoutModel, make_loader  # noqa: E402


def main() -> None:
    base, layout, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    if layout == "per_rank":  # two "nodes" of one process each
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank))
    local = f"{base}/local" if layout == "shared" else f"{base}/local-rank{rank}"
    pl.seed_everything(3)
    callback = AsyncCheckpointCallback(
        dirpath=f"{base}/durable",
        every_n_train_steps=4,
        local_dirpath=local,
        local_every_n_train_steps=2,
        save_on_train_end=False,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if layout == "shared" else 1,
        num_nodes=1 if layout == "shared" else 2,
        strategy="ddp",
        max_steps=6 if phase == "train" else 8,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(BNDropoutModel(), make_loader(n=64), ckpt_path="last" if phase == "resume" else None)
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "ckpt_path": str(trainer.ckpt_path)}), flush=True)


if __name__ == "__main__":
    main()
