"""One rank of the sharded peer-replica tests: raw FSDP2 on CPU (gloo), ``TieredShardedCheckpointer(replicas=1)``.

Usage: ``python sharded_replicas_worker.py <out> <scenario>[,<scenario>...]`` under ``tests.helpers.dist.launch_ranks``.
Each rank has its own node-local folder ``node<r>`` (``ranks_per_node=1``: two "nodes"); the durable tier is
``faulty://.../durable`` (every call counted). First a base run in ``<out>/base``: steps 1-6 trained, 1-5 saved
(each drained: every generation replicated), 2 and 4 promoted. Then each scenario runs on a copy of the base folders
(made by rank 0), damaged as named, resumes with a new checkpointer, trains on to step 6 (saving 6, promoted), and
prints ``RESULT <scenario> {json}``: the step and tier resumed, this rank's version folder, the durable reads
(``open``/``cat_file``) ``resume`` made, and which tensors differ from the base run's at the resumed step and at 6.

Scenarios:
    lost_one: rank 1's folder deleted (its replica is in rank 0's folder).
    lost_both: both folders deleted.
    damaged_replica: rank 1's folder deleted and a byte of rank 0's replica of rank 1's step 5 flipped.
    damaged_own: a byte of rank 1's own step-5 data file flipped (rank 0's replica of it intact).
    other_run: another run (its own durable tier) saves steps 7-8 into the same node folders first, replicated; the
        base run then resumes its own newest step, never the other run's newer one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import traceback
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_async_ckpt.testing  # noqa: E402, F401 - registers faulty://
from lightning_async_ckpt.errors import ConfigError  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import register_faulty  # noqa: E402
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer  # noqa: E402
from tests.helpers.sharded_tiers_worker import _model, _same, _state, _train, _weights  # noqa: E402

register_faulty()  # this process names faulty:// URLs

GROUP_TIMEOUT_S = 60.0


def _ckpt(out: str, durable_name: str = "durable", **kwargs: Any) -> TieredShardedCheckpointer:
    durable = CheckpointStore(f"faulty://{out}/{durable_name}", {"target_protocol": "file"}, check_writable=False)
    return TieredShardedCheckpointer(
        f"{out}/node{dist.get_rank()}",
        durable,
        every_n_train_steps=2,
        replicas=1,
        ranks_per_node=1,
        timeout_s=GROUP_TIMEOUT_S,
        **kwargs,
    )


def _base(out: str) -> tuple[dict[int, Any], dict[str, Any]]:
    model, opt = _model()
    ckpt = _ckpt(out)
    weights = {}
    for step in range(1, 7):
        _train(model, opt, step)
        weights[step] = _weights(model)
        if step <= 5:
            ckpt.save(step, _state(model, opt, step))
            ckpt.drain()  # saved, promoted when due, replicated: every step's replica exists
    ckpt.close()
    rank = dist.get_rank()
    held = CheckpointStore(f"{out}/node{rank}/replica-of-rank-{1 - rank}", check_writable=False)
    info = {"replica_steps": [g.step for g in held.generations()], "replica_extra": held.manifest(5).extra}
    info["own_steps"] = [g.step for g in CheckpointStore(f"{out}/node{rank}/rank-{rank}").generations()]
    return weights, info


def _refusals(out: str) -> list[str]:
    """The errors of two unusable configurations (raised before any group is created, so no rank waits)."""
    errors = []
    for local, replicas in ((f"{out}/node{dist.get_rank()}", 2), ("memory://node", 1)):
        try:
            TieredShardedCheckpointer(local, f"{out}/durable", replicas=replicas, ranks_per_node=1)
        except ConfigError as exc:
            errors.append(str(exc))
    return errors


def _flip(gen: str, prefix: str) -> None:
    data = next(f for f in os.listdir(gen) if f.startswith(prefix))
    with open(f"{gen}/{data}", "r+b") as f:
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 0xFF]))


def _scenario(base: str, out: str, name: str, weights: dict[int, Any], result: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        shutil.copytree(base, out)
        if name in ("lost_one", "lost_both", "damaged_replica"):
            shutil.rmtree(f"{out}/node1")
        if name == "lost_both":
            shutil.rmtree(f"{out}/node0")
        if name == "damaged_replica":
            _flip(f"{out}/node0/replica-of-rank-1/step-00000005", "__1_0.distcp")
        if name == "damaged_own":
            _flip(f"{out}/node1/rank-1/step-00000005", "__1_0.distcp")
    dist.barrier()
    if name == "other_run":  # another run in the same node folders: steps 7-8 saved and replicated, never resumed
        other_model, other_opt = _model()
        other = _ckpt(out, durable_name="durable-other")
        for step in (7, 8):
            _train(other_model, other_opt, step)
            other.save(step, _state(other_model, other_opt, step))
            other.drain()
        other.close()
        dist.barrier()
    model, opt = _model()
    ckpt = _ckpt(out)
    fs = ckpt.durable.fs
    before = sum(fs.count(op) for op in ("open", "cat_file"))
    state = _state(model, opt, 0)
    choice = ckpt.resume(state)
    result["durable_reads"] = sum(fs.count(op) for op in ("open", "cat_file")) - before
    assert choice is not None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result.update(step=choice.step, tier=choice.tier, version=ckpt.version, where=choice.store.uri)
    if choice.tier == "local":
        result["replica_of"] = choice.store.manifest(choice.step).extra.get("replica_of")
    result["resumed_vs_base"] = _same(_weights(model), weights[choice.step])
    for step in range(choice.step + 1, 7):
        _train(model, opt, step)
        ckpt.save(step, _state(model, opt, step))
    ckpt.drain()
    result["continued_vs_base_step6"] = _same(_weights(model), weights[6])
    result["promoted_step"] = ckpt.promoted_step
    ckpt.close()


def main(out: str, scenarios: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        refusals = _refusals(out)
        weights, info = _base(f"{out}/base")
        dist.barrier()
    except Exception:  # noqa: BLE001 - reported
        print("RESULT base " + json.dumps({"rank": rank, "exception": traceback.format_exc()}), flush=True)
        os._exit(1)
    print("RESULT base " + json.dumps({"rank": rank, "refusals": refusals, **info}), flush=True)
    for name in scenarios:
        result: dict[str, Any] = {"rank": rank}
        try:
            _scenario(f"{out}/base", f"{out}/{name}", name, weights, result)
            dist.barrier()
        except Exception:  # noqa: BLE001 - reported under the scenario's name
            print(f"RESULT {name} " + json.dumps({"rank": rank, "exception": traceback.format_exc()}), flush=True)
            os._exit(1)
        print(f"RESULT {name} " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
