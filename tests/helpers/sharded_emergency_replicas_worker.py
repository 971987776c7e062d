"""One rank of tests/sharded/test_sharded_emergency_replicas.py: raw FSDP2 on CPU (gloo),
``TieredShardedCheckpointer(replicas=1, preemption_signal=SIGUSR1)``, each rank its own folder ``node<r>``
(``ranks_per_node=1``: two "nodes", each rank's replicas go to the other).

Usage: ``python sharded_emergency_replicas_worker.py <out>``. Rank 1 alone receives a real SIGUSR1 after step 3; every
rank makes the emergency save of step 3 and, as soon as it returns (before ``close``), records what its target's
folder holds of its replicas. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer  # noqa: E402
from tests.helpers.sharded_tiers_worker import _model, _state, _train  # noqa: E402


def main(out: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = 1 - rank
    model, opt = _model()
    ckpt = TieredShardedCheckpointer(
        f"{out}/node{rank}",
        f"{out}/durable",
        every_n_train_steps=100,
        replicas=1,
        ranks_per_node=1,
        timeout_s=60.0,
        preemption_signal=signal.SIGUSR1,
    )
    result: dict = {"rank": rank, "stopped": None}
    for step in range(1, 20):
        _train(model, opt, step)
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, to rank 1 only
        if ckpt.preemption_due():
            result["where"] = ckpt.emergency_save(step, _state(model, opt, step), grace_s=120)
            # Before close(): the target's own folder, as it committed it.
            held = CheckpointStore(f"{out}/node{target}/replica-of-rank-{rank}", check_writable=False)
            result["target_holds"] = [g.step for g in held.generations()]
            result["target_verified"] = [held.verify(s).ok for s in result["target_holds"]]
            result["replicated"] = {str(k): v for k, v in ckpt.replicas.replicator.replicated.items()}
            result["stopped"] = step
            break
        if step % 2 == 0:
            ckpt.save(step, _state(model, opt, step))
    ckpt.close()
    dist.barrier()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
