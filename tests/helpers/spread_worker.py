"""One rank of the hashed-prefixes test: raw FSDP2 on CPU (gloo), data files spread over hashed key prefixes.

Usage: ``python spread_worker.py <out>`` under ``tests.helpers.dist.launch_ranks``. Saves steps 1 and 2 with
``keep_last=1`` into ``CheckpointStore(<out>/store, hashed_prefixes=True)``, finds the newest once
(``latest_once``), loads it with DCP into a fresh FSDP2 model and prints one ``RESULT {json}``: the step found, whether
the loaded local shards equal what was saved, the objects ``load_generation`` verified on this rank, and (rank 0) the manifest's spread paths and the spread files on disk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sharded_worker import make_model  # the script's folder is on sys.path
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.sharded.once import latest_once
from lightning_async_ckpt.sharded.spread import load_generation
from lightning_async_ckpt.storage.store import CheckpointStore


def _local(state: dict) -> dict:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in state.items()}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    fully_shard(model, mesh=mesh)
    saved = {}
    with ShardedCheckpointer(CheckpointStore(f"{out}/store", hashed_prefixes=True), keep_last=1) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(step))
            saved = _local(get_model_state_dict(model))
            ckpt.save(step, {"model": get_model_state_dict(model)}).result(timeout=120)
    info = latest_once(CheckpointStore(f"{out}/store", check_writable=False))
    fresh = make_model()
    fully_shard(fresh, mesh=mesh)
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=info.dcp_path)  # DCP's reader follows .metadata's ../spread/... paths
    loaded = _local(state["model"])
    result: dict = {"rank": rank, "step": info.step, "equal": all(torch.equal(loaded[k], saved[k]) for k in saved)}
    again = {"model": get_model_state_dict(fresh)}
    result["verified"] = load_generation(again, CheckpointStore(f"{out}/store", check_writable=False), info.step)
    if rank == 0:
        store = CheckpointStore(f"{out}/store", check_writable=False)
        result["root_paths"] = sorted(o.root_path for o in store.manifest(2).objects if o.root_path)
        spread = Path(out, "store", "spread")
        result["spread_files"] = sorted(str(p.relative_to(spread.parent)) for p in spread.rglob("*") if p.is_file())
        result["steps"] = [g.step for g in store.generations(include_uncommitted=True)]
        result["store_verified"] = store.verify(2).ok
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
