"""Training-thread blocking per checkpoint: synchronous ``torch.save`` against the engine's two capture modes.

A CPU model of ``--params-mb`` of fp32 parameters (a stack of square ``Linear`` layers) trains with Adam, so the
checkpoint holds about three times that (parameters plus two moments). Every ``--every`` steps it is checkpointed
``--checkpoints`` times in each mode:

* ``sync``: ``torch.save`` of the state dicts to a file on the same disk, flushed and fsynced, on the training
  thread;
* ``copy-at-cut``: ``AsyncCheckpointer.save(..., defer=False)``: every tensor copied at the cut, serialization
  and upload in the background;
* ``fenced``: ``attach(model, optimizer)`` and ``defer=True``: parameters and Adam moments staged in the
  background, waited for right before the next optimizer step.

Blocking is what the training thread waits for: the whole save (sync); the ``save`` call, which includes
admission waits and copies at the cut, plus the waits at the fences (engine modes). Step time is one
forward/backward/update, fence waits included; its median per mode shows the interference of the background
work with training. The fenced mode's staging throughput (deferred bytes / staging seconds) is printed beside a
plain ``copy_`` of the same storages into preallocated buffers. Prints; asserts nothing.

Usage::

    python benchmarks/bench_engine.py                     # ~500 MB of parameters, a checkpoint every 3 steps
    python benchmarks/bench_engine.py --params-mb 128 --every 2 --checkpoints 5 --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.storage.store import CheckpointStore

MB = 1_000_000
GB = 1_000_000_000


def _model(params_mb: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    per_layer = (width * width + width) * 4
    layers = max(1, round(params_mb * MB / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": step}


def _nbytes(state: Any) -> int:
    seen: dict[int, int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                visit(v)

    visit(state)
    return sum(seen.values())


class _Run:
    """One mode's measurements."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.step_s: list[float] = []
        self.blocked_s: list[float] = []
        self.admission_s: list[float] = []
        self.staging_bps: list[float] = []
        self.cut_to_committed_s: list[float] = []
        self.drain_s = 0.0
        self.wall_s = 0.0


def _train(
    run: _Run,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    every: int,
    checkpoints: int,
    checkpoint: Callable[[int], None],
) -> None:
    t_start = time.perf_counter()
    for step in range(1, every * checkpoints + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()
        opt.step()
        run.step_s.append(time.perf_counter() - t0)
        if step % every == 0:
            checkpoint(step)
    run.wall_s = time.perf_counter() - t_start


def _sync(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, folder: str, args: Any) -> _Run:
    run = _Run("sync torch.save")
    os.makedirs(folder)

    def checkpoint(step: int) -> None:
        path = os.path.join(folder, f"step-{step:08d}.ckpt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(_state(model, opt, step), f)
            f.flush()
            os.fsync(f.fileno())
        run.blocked_s.append(time.perf_counter() - t0)
        for old in os.listdir(folder):  # keep the last one, like keep_last=1
            if old != os.path.basename(path):
                os.unlink(os.path.join(folder, old))

    _train(run, model, opt, batch, args.every, args.checkpoints, checkpoint)
    return run


def _engine(
    model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, folder: str, args: Any, *, fenced: bool
) -> tuple[_Run, str]:
    run = _Run("fenced deferral" if fenced else "copy-at-cut")
    ckpt = AsyncCheckpointer(CheckpointStore(folder), keep_last=1, host_memory_budget="auto")
    if fenced:
        ckpt.attach(model, opt)
    handles = []
    plan_text = ""

    def checkpoint(step: int) -> None:
        handle = ckpt.save(step, _state(model, opt, step), modules=[model], optimizers=[opt], defer=fenced)
        handles.append(handle)

    try:
        _train(run, model, opt, batch, args.every, args.checkpoints, checkpoint)
        t0 = time.perf_counter()
        ckpt.drain()
        run.drain_s = time.perf_counter() - t0
        if fenced:
            ckpt.wait(Fence.OPTIMIZER_STEP)
    finally:
        ckpt.close()
    for handle in handles:
        rec = handle.record
        run.blocked_s.append(rec.blocked_s + sum(rec.fence_wait_s.values()))
        run.admission_s.append(rec.admission_wait_s)
        if rec.cut_to_committed_s is not None:
            run.cut_to_committed_s.append(rec.cut_to_committed_s)
        if rec.deferred_bytes and rec.staging_s > 0:
            run.staging_bps.append(rec.deferred_bytes / rec.staging_s)
    if handles and handles[-1].plan is not None:
        plan_text = handles[-1].plan.describe()
    return run, plan_text


def _memcpy_bps(state: Any, repeat: int = 5) -> float:
    """``copy_`` of every distinct storage of ``state`` into preallocated uint8 buffers, best of ``repeat``."""
    storages = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)

    visit(state)
    sources = [torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)) for s in storages.values()]
    dests = [torch.empty_like(s) for s in sources]
    total = sum(s.numel() for s in sources)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for d, s in zip(dests, sources, strict=True):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return total / best


def _fmt_s(values: list[float]) -> str:
    if not values:
        return "-"
    return f"mean {statistics.fmean(values):7.3f}  max {max(values):7.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-mb", type=int, default=500, help="fp32 parameter megabytes (default 500)")
    parser.add_argument("--width", type=int, default=2048, help="Linear layer width (default 2048)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps (default 3)")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints per mode (default 3)")
    parser.add_argument("--dir", default=None, help="parent folder for the temporary stores (default: /tmp)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the first mode (default 3)")
    args = parser.parse_args(argv)

    model, opt = _model(args.params_mb, args.width)
    batch = torch.randn(args.batch, args.width)
    for _ in range(max(1, args.warmup)):  # Adam state exists, allocator and caches are warm
        opt.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()
        opt.step()
    state_bytes = _nbytes(_state(model, opt, 0))
    params = sum(p.numel() for p in model.parameters())

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"model: {len(model)} x Linear({args.width}, {args.width}), {params / 1e6:.1f} M params "
          f"({params * 4 / MB:.0f} MB fp32); checkpoint state {state_bytes / MB:.0f} MB with Adam moments")  # fmt: skip
    print(f"checkpoint every {args.every} steps, {args.checkpoints} checkpoints per mode, batch {args.batch}\n")

    root = tempfile.mkdtemp(prefix="bench_engine-", dir=args.dir)
    try:
        runs = [_sync(model, opt, batch, os.path.join(root, "sync"), args)]
        shutil.rmtree(os.path.join(root, "sync"))
        cut_run, _ = _engine(model, opt, batch, os.path.join(root, "cut"), args, fenced=False)
        runs.append(cut_run)
        shutil.rmtree(os.path.join(root, "cut"))
        fenced_run, plan_text = _engine(model, opt, batch, os.path.join(root, "fenced"), args, fenced=True)
        runs.append(fenced_run)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("training-thread blocking per checkpoint (seconds)")
    print(f"{'mode':<18}{'blocked':<30}{'admission wait':<30}{'median step s':>14}{'drain at end s':>16}{'wall s':>9}")
    for run in runs:
        print(
            f"{run.name:<18}{_fmt_s(run.blocked_s):<30}{_fmt_s(run.admission_s):<30}"
            f"{statistics.median(run.step_s):>14.3f}{run.drain_s:>16.2f}{run.wall_s:>9.1f}"
        )
    for run in runs[1:]:
        if run.cut_to_committed_s:
            print(f"{run.name}: cut to committed {_fmt_s(run.cut_to_committed_s)} s")

    memcpy = _memcpy_bps(_state(model, opt, 0))
    staged = statistics.median(fenced_run.staging_bps) if fenced_run.staging_bps else float("nan")
    print(f"\nstaging copy (fenced, background thread): {staged / GB:.2f} GB/s (deferred bytes / staging_s, median)")
    print(f"plain memory copy_ of the same storages:   {memcpy / GB:.2f} GB/s (best of 5, training stopped)")
    print("\ncapture plan of the fenced mode's last checkpoint:")
    print(plan_text)


if __name__ == "__main__":
    main()
