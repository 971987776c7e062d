"""Does a second outstanding save pay? max_outstanding=1 against 2, under storage that keeps up and one that does not.

A plain PyTorch loop checkpoints a model every ``--every`` steps into a bandwidth-capped store
(``lightning_async_ckpt.testing.FaultyFileSystem``). For each storage speed and each ``max_outstanding`` it prints:
committed checkpoints, skipped or waited requests, the training time lost to admission waits and fences, the
committed throughput (checkpoints per minute) and the peak retained staging memory. Prints; asserts nothing.

    python benchmarks/bench_outstanding.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore


def run(args: argparse.Namespace, bandwidth_mbps: float, max_outstanding: int, folder: str) -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(args.batch, args.width)
    store = CheckpointStore(f"faulty://{folder}", {"target_protocol": "file", "bandwidth_bps": bandwidth_mbps * 1e6})
    ckpt = AsyncCheckpointer(store, max_outstanding=max_outstanding, admission=args.admission, host_memory_budget=None)
    ckpt.attach(model, opt)
    step_times = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, modules=[model], optimizers=[opt])
        step_times.append(time.perf_counter() - t0)
    train_s = time.perf_counter() - t_start
    ckpt.close()
    records = list(ckpt.records)
    committed = [r for r in records if r.outcome == "committed"]
    median = statistics.median(step_times)
    return {
        "bandwidth_MBps": bandwidth_mbps,
        "max_outstanding": max_outstanding,
        "requested": len(records),
        "committed": len(committed),
        "skipped": sum(r.outcome in ("skipped", "coalesced") for r in records),
        "admission_wait_s": round(sum(r.admission_wait_s for r in records), 2),
        "fence_wait_s": round(sum(sum(r.fence_wait_s.values()) for r in records), 2),
        "lost_training_s": round(sum(step_times) - median * len(step_times), 2),
        "committed_per_min": round(len(committed) / train_s * 60, 1),
        "peak_retained_MB": round(max((r.peak_retained_bytes for r in records), default=0) / 1e6),
        "ckpt_MB": round(committed[-1].bytes / 1e6) if committed else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--admission", default="skip", choices=("wait", "skip", "coalesce"))
    parser.add_argument("--bandwidths", default="400,40", help="storage MB/s to compare: keeps up, and slower")
    args = parser.parse_args()
    print(
        f"# {args.layers} x Linear({args.width}) + Adam, checkpoint every {args.every} of {args.steps} steps, "
        f"admission={args.admission}"
    )
    for bw in (float(b) for b in args.bandwidths.split(",")):
        for outstanding in (1, 2):
            folder = tempfile.mkdtemp(prefix="lac-outstanding-")
            try:
                print(run(args, bw, outstanding, folder), flush=True)
            finally:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
