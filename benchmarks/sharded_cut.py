"""Per-rank cut cost of ShardedCheckpointer against DCP's async_save and save, 2 CPU ranks (gloo), raw FSDP2.

Usage: ``python benchmarks/sharded_cut.py --out /tmp/shbench [--layers 8] [--width 1024] [--repeats 3]``

A micro-benchmark of the cut alone (copy-at-cut, no training between saves). ``lightning-async-ckpt bench sharded``
(``benchmarks/_bench_sharded.py``) is the full comparison: fenced staging in a training loop, DCP ``async_save``
thread and process, persist throughput against the raw write floor.

Launches itself as two ranks. Each rank prints one JSON line: the training-thread blocking time of
``ShardedCheckpointer.save`` (copy-at-cut) and of ``dcp.async_save`` (thread), the time until each is committed,
and a synchronous ``dcp.save``, for the same state dict (model + Adam state). A first save of each kind warms up
(buffer allocation, DCP caches) and is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_async_ckpt.sharded import ShardedCheckpointer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    local_bytes = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for sd in state().values() for t in _tensors(sd)
    )
    rows: dict[str, list[tuple[float, float]]] = {"sharded": [], "async_save": [], "save": []}
    ckpt = ShardedCheckpointer(f"{args.out}/store")
    group = dist.new_group(backend="gloo")
    for i in range(args.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        handle = ckpt.save(i, state())
        t1 = time.perf_counter()
        handle.result(timeout=600)
        rows["sharded"].append((t1 - t0, time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state(), checkpoint_id=f"{args.out}/async-{i}", process_group=group)
        t1 = time.perf_counter()
        fut.result()
        rows["async_save"].append((t1 - t0, time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state(), checkpoint_id=f"{args.out}/sync-{i}", process_group=group)
        rows["save"].append((time.perf_counter() - t0, time.perf_counter() - t0))
    ckpt.close()
    out = {"rank": rank, "local_state_mb": round(local_bytes / 2**20, 1)}
    for name, samples in rows.items():
        counted = samples[1:]
        out[name] = {
            "blocked_ms": round(1000 * min(s[0] for s in counted), 1),
            "done_ms": round(1000 * min(s[1] for s in counted), 1),
        }
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def _tensors(obj: object) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a folder for the checkpoints (emptied by you)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (width x width each)")
    parser.add_argument("--width", type=int, default=1024, help="features per layer")
    parser.add_argument("--repeats", type=int, default=3, help="counted saves of each kind (min is reported)")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        _rank(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank-worker"], env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
