"""Where the CPU goes in one save: the training thread at the cut and fences, and each background thread, per GB.

Usage: ``python benchmarks/profile_cpu.py [--state-mb 800] [--saves 3] [--dir DIR]``

A plain loop (4 square ``Linear`` layers + Adam, ``AsyncCheckpointer(...).attach(model, optimizer)``, the library's
defaults: deferral, exact guard, CRC-32C, direct I/O on local disk) saves every few steps. Measured with thread CPU
clocks, not wall time, so another process on the machine changes the figures little:

* the training thread: CPU seconds inside ``save`` (the cut: plan, copy at the cut, the guard's fingerprint) and
  inside the fence waits, per GB of checkpoint;
* every library thread (by name, ``/proc/self/task/<tid>/stat``), and short-lived ones together (the guard's
  parallel checksum threads): CPU seconds per GB;
* the same for a synchronous ``torch.save`` of the same state into a file (the reference a user pays today).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import threading
import time

import torch

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.core.capture import Fence

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live Python thread of this process, by thread name."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[thread.name] = out.get(thread.name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=800.0, help="checkpoint size in MB (params + Adam x2)")
    parser.add_argument("--saves", type=int, default=3, help="saves to profile (default 3)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    args = parser.parse_args()
    width = max(64, int((args.state_mb * 1e6 / 3 / 4 / 4) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    folder = args.dir or tempfile.mkdtemp(prefix="lac-profile-")
    x = torch.randn(8, width)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step()  # Adam state exists from here
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    gb = nbytes * args.saves / 1e9
    cut_cpu = fence_cpu = 0.0
    store = CheckpointStore(os.path.join(folder, "ckpt"))
    ckpt = AsyncCheckpointer(store, host_memory_budget=None, keep_last=1).attach(model, opt)
    original_wait = ckpt.wait

    def timed_wait(fence: Fence, **kwargs: object) -> float:
        nonlocal fence_cpu
        t0 = time.thread_time()
        try:
            return original_wait(fence, **kwargs)  # type: ignore[arg-type]
        finally:
            fence_cpu += time.thread_time() - t0

    ckpt.wait = timed_wait  # type: ignore[method-assign]
    c0 = _process_cpu()
    for _ in range(2 * args.saves):  # the same training steps without saves: their CPU (torch's own threads too)
        step()
    training_cpu = _process_cpu() - c0
    before_threads, before_process, before_main = _thread_cpu(), _process_cpu(), time.thread_time()
    for i in range(args.saves):
        t0 = time.thread_time()
        handle = ckpt.save(
            i + 1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, modules=[model], optimizers=[opt]
        )
        cut_cpu += time.thread_time() - t0
        step()
        step()
        handle.committed.result()
    after_threads = _thread_cpu()
    main_cpu = time.thread_time() - before_main
    ckpt.close()
    process_cpu = _process_cpu() - before_process
    per_thread = {
        name: cpu - before_threads.get(name, 0.0)
        for name, cpu in after_threads.items()
        if name.startswith(("lightning_async_ckpt", "lightning-async-ckpt"))
    }
    named = sum(per_thread.values())
    print(
        f"# state {nbytes / 1e6:.0f} MB x {args.saves} saves = {gb:.2f} GB; torch {torch.__version__}, "
        f"{os.cpu_count()} cores"
    )
    print("| where | CPU s per GB |")
    print("|---|---|")
    print(f"| training thread: inside save (the cut) | {cut_cpu / gb:.3f} |")
    print(f"| training thread: inside fence waits | {fence_cpu / gb:.3f} |")
    for name, cpu in sorted(per_thread.items(), key=lambda kv: -kv[1]):
        print(f"| thread {name} | {cpu / gb:.3f} |")
    main_training = main_cpu - cut_cpu - fence_cpu
    other = process_cpu - main_cpu - named - max(0.0, training_cpu - main_training)
    print(f"| short-lived threads (guard checksum pool, direct-write thread) | {max(0.0, other) / gb:.3f} |")
    work = (process_cpu - training_cpu) / gb
    print(f"| all checkpoint work (process CPU minus the same steps without saves) | {work:.3f} |")
    path = os.path.join(folder, "sync.pt")
    t0, c0 = time.perf_counter(), _process_cpu()
    for _ in range(args.saves):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    print(f"| reference: synchronous torch.save + fsync, CPU | {(_process_cpu() - c0) / gb:.3f} |")
    print(f"| reference: synchronous torch.save + fsync, wall | {(time.perf_counter() - t0) / gb:.3f} |")
    if args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
