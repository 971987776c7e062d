"""One rank of the Lightning half of tests/sharded/test_sharded_emergency_replicas.py: ``ModelParallelStrategy``
(FSDP2) on 2 CPU ranks, ``AsyncCheckpointCallback(local_dirpath=<out>/node<r>, replicas=1,
preemption_signal=SIGUSR1)``; rank 1 alone receives a real SIGUSR1 at step 5.

Usage: ``python sharded_emergency_replicas_lightning_worker.py <out>``. Prints ``RESULT {json}``: the step training
stopped at, the callback's emergency log lines on this rank, and what the target's folder holds of this rank's
replicas after the fit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import lightning.pytorch as pl
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from tests.helpers.lightning_sharded_worker import ShardedModel, fit  # noqa: E402


class Signal(pl.Callback):
    """Rank 1 sends itself SIGUSR1 at the end of step 5 (before the checkpoint callback's hook of that batch)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.rank == 1 and trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGUSR1)


def _fit(callbacks: list, max_steps: int) -> tuple[pl.LightningModule, pl.Trainer]:
    model = ShardedModel("plain")
    return model, fit(model, callbacks, max_steps)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(out: str) -> None:
    lines = Lines()
    logging.getLogger("lightning_async_ckpt").addHandler(lines)
    callback = AsyncCheckpointCallback(
        dirpath=f"{out}/durable",
        every_n_train_steps=100,
        local_dirpath=f"{out}/node{os.environ['RANK']}",
        local_every_n_train_steps=100,
        replicas=1,
        preemption_signal=signal.SIGUSR1,
        preemption_grace_s=120,
    )
    rank = int(os.environ["RANK"])
    _, trainer = _fit([Signal(rank), callback], 12)
    held = CheckpointStore(f"{out}/node{1 - rank}/replica-of-rank-{rank}", check_writable=False)
    result = {
        "rank": rank,
        "stopped": trainer.global_step,
        "emergency": [line for line in lines.lines if line.startswith("emergency checkpoint")],
        "target_holds": [g.step for g in held.generations()],
    }
    print("RESULT " + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
