"""Accelerate with FSDP2 on 2 CPU ranks (gloo): the library's ``save_state`` beside accelerate's own and DCP's.

Usage: ``python benchmarks/accelerate_fsdp2.py --out /tmp/accbench [--layers 8] [--width 1024] [--steps 12]
[--every 3]``

Launches itself as two ranks. accelerate prepares FSDP2 only on accelerator devices, so each rank forces the
state's distributed type to FSDP (as ``tests/helpers/accelerate_fsdp_worker.py`` does) and ``accelerator.prepare``
then shards with ``fully_shard``. The same training loop runs once per mode, a checkpoint every ``--every`` steps:

- ``ours``: ``lightning_async_ckpt.accelerate.save_state(accelerator, uri)`` (fenced staging of each rank's shards);
- ``accelerate``: ``accelerator.save_state(folder)`` (synchronous DCP, accelerate's own);
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (thread) of the same model and optimizer state dicts.

Each rank prints one JSON line per mode: the training-thread blocking per checkpoint (the call, plus the wait for
the previous save when the next is due, plus for ``ours`` the fence waits it caused; median of the counted saves,
the first is a warm-up), the host bytes the save holds on that rank (``ours``: its pooled buffers; ``dcp_async``:
DCP's staged copy of the rank's state; ``accelerate``: none beyond what its writer buffers), and cut to committed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any


def _prepare(args: argparse.Namespace) -> tuple[Any, ...]:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # accelerate: FSDP only on accelerators
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    acc.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from lightning_async_ckpt.accelerate import attach, save_state

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for mode in ("ours", "accelerate", "dcp_async"):
        acc, model, opt = _prepare(args)
        batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(acc.process_index))
        group = dist.new_group(backend="gloo")
        ckpt = attach(acc, f"{args.out}/{mode}") if mode == "ours" else None
        blocked, committed, held, pending = [], [], [], []

        def finish(entry: tuple[Any, float]) -> float:
            obj, cut = entry
            getattr(obj, "committed", obj).result(timeout=600)
            return time.perf_counter() - cut

        dist.barrier()
        for i in range(1, args.steps + 1):
            model(batch).square().mean().backward()
            opt.step()  # ours: the fence waits here for the previous cut's staging
            opt.zero_grad()
            if i % args.every:
                continue
            b0 = time.perf_counter()
            if pending:
                committed.append(finish(pending.pop()))
            cut = time.perf_counter()
            if mode == "ours":
                handle = save_state(acc, f"{args.out}/{mode}")
                held.append(handle.plan.summary()["total_bytes"])
                pending.append((handle, cut))
            elif mode == "accelerate":
                acc.save_state(f"{args.out}/{mode}/step-{i}")
                committed.append(time.perf_counter() - cut)
                held.append(0)
            else:
                state = {
                    "model": get_model_state_dict(model),
                    "optimizer": get_optimizer_state_dict(model, opt.optimizer),
                }
                held.append(sum(t.to_local().nbytes for t in _tensors(state) if hasattr(t, "to_local")))
                pending.append(
                    (dcp.async_save(state, checkpoint_id=f"{args.out}/{mode}/step-{i}", process_group=group), cut)
                )
            blocked.append(time.perf_counter() - b0)
        if pending:
            committed.append(finish(pending.pop()))
        fence = [h.fence_wait_s for h in ckpt.handles] if ckpt is not None else [0.0] * len(blocked)
        if ckpt is not None:
            ckpt.close()
        totals = [b + w for b, w in zip(blocked, fence, strict=False)]
        out[mode] = {
            "blocking_ms": round(1000 * statistics.median(totals[1:] or totals), 1),
            "host_mb": round(max(held) / 1e6, 2),
            "cut_to_committed_s": round(statistics.median(committed[1:] or committed), 3),
        }
        dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), **out}), flush=True)
    dist.destroy_process_group()


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
    parser.add_argument("--batch", type=int, default=64, help="batch size per rank")
    parser.add_argument("--steps", type=int, default=12, help="training steps per mode")
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
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
        env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank-worker"], env=env))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
