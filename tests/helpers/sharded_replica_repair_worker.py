"""One rank of tests/core/test_replica_repair_dcp.py: raw FSDP2 on CPU (gloo), ``TieredShardedCheckpointer(replicas=1,
ranks_per_node=1)``, each rank its own folder ``node<r>``.

Usage: ``python sharded_replica_repair_worker.py <out>``. Steps 1-2 saved (each replicated to the other rank); rank 1
flips a byte of its replica of rank 0's step 2 (its manifest unchanged); rank 0 replicates step 2 again; then rank
0's folder is deleted and a new checkpointer resumes: rank 0's part must come back from rank 1's repaired replica.
Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.tiers.peer_replicas import held_replicas, replica_store  # noqa: E402
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer  # noqa: E402
from tests.helpers.sharded_tiers_worker import _model, _same, _state, _train, _weights  # noqa: E402


def _ckpt(out: str) -> TieredShardedCheckpointer:
    return TieredShardedCheckpointer(
        f"{out}/node{dist.get_rank()}", f"{out}/durable", replicas=1, ranks_per_node=1, timeout_s=60.0
    )


def _verified(local: str) -> dict:
    """{version: {step: intact}} of this folder's replicas of rank 0."""
    return {
        str(version): {str(step): replica_store(local, version, 0).verify(step).ok for step in (1, 2)}
        for version in sorted({v for v in held_replicas(local, 2).get(0, {}).values()} | {0})
    }


def main(out: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local = f"{out}/node{rank}"
    model, opt = _model()
    ckpt = _ckpt(out)
    weights = {}
    for step in (1, 2):
        _train(model, opt, step)
        weights[step] = _weights(model)
        ckpt.save(step, _state(model, opt, step))
        ckpt.drain()  # saved and replicated
    dist.barrier()
    result: dict = {"rank": rank}
    if rank == 1:
        gen = f"{local}/replica-of-rank-0/step-00000002"
        data = next(f for f in os.listdir(gen) if f.startswith("__0_0.distcp"))
        with open(f"{gen}/{data}", "r+b") as f:  # bit rot: one byte; the size and the manifest unchanged
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 0xFF]))
        result["damaged"] = _verified(local)
    dist.barrier()
    if rank == 0:
        ckpt.replicas.replicate(ckpt.store, 2)  # the same step again
    ckpt.drain()
    result["copied"] = {str(k): v for k, v in ckpt.replicas.replicator.copied.items()}
    ckpt.close()
    dist.barrier()
    if rank == 1:
        result["repaired"] = _verified(local)
        result["held"] = {str(s): {str(k): v for k, v in h.items()} for s, h in held_replicas(local, 2).items()}
    else:
        shutil.rmtree(local)  # rank 0's own part is lost: only rank 1's replica can bring it back
    dist.barrier()
    model, opt = _model()
    ckpt = _ckpt(out)
    state = _state(model, opt, 0)
    choice = ckpt.resume(state)
    assert choice is not None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result.update(step=choice.step, tier=choice.tier, resumed_vs_saved=_same(_weights(model), weights[choice.step]))
    result["replica_of"] = choice.store.manifest(choice.step).extra.get("replica_of")
    ckpt.close()
    dist.barrier()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
