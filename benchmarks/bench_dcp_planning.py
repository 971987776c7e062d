"""Bytes of DCP's collectives per sharded save, with and without plan caching (issue 27 item 6), on 2 gloo ranks.

Runs itself as two ranks (gloo on loopback, CPU). Each rank shards a model of ``LAYERS`` linear layers with FSDP2
and saves it three times with ``ShardedCheckpointer`` into a local folder, once with ``plan_caching=False`` and
once with ``plan_caching=True``. The pickled size of every object DCP's ``_DistWrapper`` gathers, scatters or
broadcasts is recorded on rank 0 (what it sends or receives), by phase: ``plan`` (gather of the local plans,
scatter of the global plan) and ``write`` (gather of the write results, broadcast of the global metadata).

Run: ``python benchmarks/bench_dcp_planning.py [LAYERS]`` (default 64). Prints a markdown table.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Any


def _rank(out: str, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import utils
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_async_ckpt.sharded import ShardedCheckpointer

    sizes: dict[str, int] = defaultdict(int)
    phase = {"calls": 0}

    def record(kind: str, value: Any) -> None:
        # reduce_scatter("plan") is gather then scatter; all_reduce("write") is gather then broadcast.
        name = "plan" if phase["calls"] < 2 else "write"
        phase["calls"] += 1
        sizes[f"{name} {kind}"] += len(pickle.dumps(value))

    gather, scatter, bcast = utils._DistWrapper.gather_object, utils._DistWrapper.scatter_object, None
    bcast = utils._DistWrapper.broadcast_object

    def gather_object(self: Any, obj: Any) -> Any:
        out = gather(self, obj)
        record("gather", out if out is not None else obj)
        return out

    def scatter_object(self: Any, objs: Any) -> Any:
        out = scatter(self, objs)
        record("scatter", objs if objs is not None else out)
        return out

    def broadcast_object(self: Any, obj: Any) -> Any:
        out = bcast(self, obj)
        record("broadcast", out)
        return out

    utils._DistWrapper.gather_object = gather_object
    utils._DistWrapper.scatter_object = scatter_object
    utils._DistWrapper.broadcast_object = broadcast_object

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    results = {}
    for caching in (False, True):
        with ShardedCheckpointer(f"{out}/store-{caching}", plan_caching=caching, timeout_s=60) as ckpt:
            per_save = []
            for step in (1, 2, 3):
                sizes.clear()
                phase["calls"] = 0
                msd, osd = get_state_dict(model, opt)
                ckpt.save(step, {"model": msd, "optim": osd}).result(timeout=120)
                per_save.append(dict(sizes))
        results[str(caching)] = per_save
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def main(layers: int) -> None:
    """Launch two ranks and print the table."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
            env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
            argv = [sys.executable, __file__, "--rank", out, str(layers)]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise SystemExit(err[-3000:])
    line = [x for x in outs[0][0].splitlines() if x.startswith("RESULT ")][-1]
    results = json.loads(line.removeprefix("RESULT "))
    keys = sorted({k for saves in results.values() for save in saves for k in save})
    print(f"| rank 0, bytes ({layers} layers, 2 ranks) | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for caching, saves in results.items():
        for i, save in enumerate(saves, 1):
            label = f"plan_caching={caching}, save {i}"
            print(f"| {label} | " + " | ".join(f"{save.get(k, 0):,}" for k in keys) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(sys.argv[2], int(sys.argv[3]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
