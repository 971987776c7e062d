"""A tiered Lightning fit killed (``os._exit``) in the middle of promoting step 4, launched by test_tiers.py.

Usage: python promotion_kill_worker.py BASE STAGE   (STAGE: ``object`` - while step 4's checkpoint file is being
written to dirpath; ``manifest`` - right before dirpath's manifest of step 4 is written)
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from lightning_async_ckpt.testing import (
    Fault,  # noqa: E402
    register_faulty,
)
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs  # noqa: E402

register_faulty()  # this process names faulty:// URLs

KILLED = 17


def main() -> None:
    base, stage = sys.argv[1], sys.argv[2]
    op, path = (
        ("write", "step-00000004/epoch=0-step=4.ckpt")
        if stage == "object"
        else ("pipe_file", "step-00000004/manifest.json")
    )
    fault = Fault(op=op, path=path, callback=lambda call: os._exit(KILLED))
    callback = AsyncCheckpointCallback(
        dirpath=f"faulty://{base}/durable",
        storage_options={"target_protocol": "file", "faults": [fault]},
        every_n_train_steps=4,
        local_dirpath=f"{base}/local",
        local_every_n_train_steps=2,
    )
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=8, accumulate_grad_batches=2, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader())


if __name__ == "__main__":
    main()
