"""Lightning sharded peer replicas: the fits and checks of one rank, ``ModelParallelStrategy`` (FSDP2) or sliced DDP.

The replica part of ``tests/helpers/lightning_sharded_tiers_replicas_worker.py`` (``run_replicas``), which launches
it; the kind is ``sys.argv[2]`` of that launch (read by ``sharded_tiers_lightning_worker``). Each rank has its own
node-local folder ``<out>/node<r>`` (as on two nodes). ``kind``: ``mp`` (``ModelParallelStrategy``, FSDP2) or
``sliced`` (``DDPStrategy`` with ``ddp_layout="sliced"``; its dropout's random state is not restored by Lightning, so
its weights are not compared with the uninterrupted fit's).

1. ``reference`` (run by the launching worker, shared with the two-tier part): 12 steps without checkpoints; the full
   weights at step 12 (rank 0 holds them).
2. ``first``: 8 steps with ``AsyncCheckpointCallback(dirpath=<out>/durable, every_n_train_steps=4,
   local_dirpath=<out>/node<r>, local_every_n_train_steps=2, local_keep_last=2, replicas=1)``; both tiers are copied
   to ``<out>/lost`` and rank 1's local folder there is deleted.
3. ``resumed``: in ``<out>/lost``, a fresh model with ``ckpt_path="last"``: rank 1 gets step 8 back from rank 0's
   replica into its own folder and loads it from there; trains to 12.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import AsyncCheckpointCallback  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from tests.helpers.sharded_tiers_lightning_worker import KIND, Record, _fit, _full, _same  # noqa: E402


def _callback(out: str, rank: int) -> AsyncCheckpointCallback:
    return AsyncCheckpointCallback(
        dirpath=f"{out}/durable",
        every_n_train_steps=4,
        save_top_k=-1,
        local_dirpath=f"{out}/node{rank}",
        local_every_n_train_steps=2,
        local_keep_last=2,
        replicas=1,
        ddp_layout="sliced" if KIND == "sliced" else "single",
    )


def _steps(path: str) -> list[int]:
    return [g.step for g in CheckpointStore(path, check_writable=False).generations()]


def run_replicas(out: str, record: Record) -> dict:
    """Steps 2-3 above in ``out``; ``record`` holds the reference fit's full weights at step 12."""
    rank = dist.get_rank()
    result: dict = {"rank": rank, "kind": KIND}
    _fit([_callback(out, rank)], 8, ckpt_path="last")  # nothing on either tier yet: a fresh start
    result["own"] = _steps(f"{out}/node{rank}/rank-{rank}")
    result["replica"] = _steps(f"{out}/node{rank}/replica-of-rank-{1 - rank}")
    result["durable"] = _steps(f"{out}/durable")
    shutil.copytree(f"{out}/node{rank}", f"{out}/lost/node{rank}")
    if rank == 0:
        shutil.copytree(f"{out}/durable", f"{out}/lost/durable")
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{out}/lost/node1")  # rank 1's node lost its local tier between the runs
    dist.barrier()
    model, trainer = _fit([_callback(f"{out}/lost", rank)], 12, ckpt_path="last")
    result.update(start=model.start_step, path=str(trainer.ckpt_path))
    weights = _full(model)  # a collective; rank 0 holds the full weights
    result["vs_reference_12"] = _same(weights, record.weights[12]) if rank == 0 and KIND == "mp" else None
    result["restored_own"] = _steps(f"{out}/lost/node{rank}/rank-{rank}")
    return result
