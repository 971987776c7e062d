"""What the exact guard costs on CUDA: the device-side fingerprint of deferred state, per GB, beside the D2H floor.

For each size (one fp32 CUDA parameter, the deferred state of a checkpoint):

* ``cut, host``: ``CutGuard.record`` in the default (exact) mode on the training thread: the fingerprint kernels
  are only enqueued on the compute stream (no host synchronization), so this is the training thread's cost;
* ``fingerprint, device``: the same kernels' time on the GPU (CUDA events), which the compute stream pays;
* ``pinned D2H``: one copy of the same bytes into pinned host memory (the staging copy's floor);
* ``check, staging thread``: the position-weighted checksum of the staged host copy (``checksum``), which runs
  on the staging thread after the copy landed.

Each figure is the best of ``--repeats``. Prints a markdown table; asserts nothing. Usage::

    python benchmarks/bench_cuda_guard.py --sizes-mb 256 1024 2400
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.fingerprint import checksum
from lightning_async_ckpt.core.guard import CutGuard, GuardMode


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        best = min(best, fn())
    return best


def _measure(mb: float, repeats: int, proof: DeferralProof) -> list[float]:
    n = int(mb * 1e6 / 4)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(n, device="cuda"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = CapturePlan.build({"w": model.w.detach()}, modules=[model], optimizers=[opt], proof=proof)
    host = torch.empty(n * 4, dtype=torch.uint8, pin_memory=True)

    def cut_host() -> float:
        guard = CutGuard(plan.slots, GuardMode.FULL)
        t0 = time.perf_counter()
        guard.record()
        return time.perf_counter() - t0

    def device() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        guard = CutGuard(plan.slots, GuardMode.FULL)
        start.record()
        guard.record()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def d2h() -> float:
        t0 = time.perf_counter()
        host.copy_(model.w.detach().view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def check() -> float:
        t0 = time.perf_counter()
        checksum(host)
        return time.perf_counter() - t0

    return [_best(f, repeats) * 1e3 for f in (cut_host, device, d2h, check)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[256, 1024, 2400])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    proof = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("bench",))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| MB | cut, host ms | fingerprint, device ms | pinned D2H ms | check, staging thread ms | device ms/GB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for mb in args.sizes_mb:
        figures = _measure(mb, args.repeats, proof)
        per_gb = figures[1] / (mb / 1e3)
        print(f"| {mb:.0f} | " + " | ".join(f"{v:.2f}" for v in figures) + f" | {per_gb:.2f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
