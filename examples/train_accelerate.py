"""Train a small model with Accelerate and asynchronous checkpoints, then resume from the newest committed one.

    python examples/train_accelerate.py --dirpath runs/accelerate-demo
    torchrun --nproc_per_node 2 examples/train_accelerate.py --cpu      # two processes (gloo on CPU)

Both paths of the integration run here: ``save_state(accelerator, uri)`` every ``--every`` steps writes everything
in the background as ``<dirpath>/store/step-XXXXXXXX/``; the final ``accelerator.save_state(<dirpath>/final)`` is
accelerate's own call, with only the weights written asynchronously. Each folder is loadable by
``accelerator.load_state`` once its ``manifest.json`` exists.
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.accelerate import attach, load_state, save_state


def build(accelerator: Accelerator, width: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = nn.Sequential(nn.Linear(32, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    return accelerator.prepare(model, optimizer, scheduler)


def train(accelerator: Accelerator, model, optimizer, scheduler, steps: int) -> float:
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(64, 32, device=accelerator.device)
        y = torch.randint(0, 10, (64,), device=accelerator.device)
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()  # the fence: a pending snapshot of the weights is staged before this update
        scheduler.step()
        optimizer.zero_grad()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="runs/accelerate-demo")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=40, help="save_state every N optimizer steps")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--cpu", action="store_true", help="force CPU (gloo) even where CUDA exists")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu)
    if accelerator.is_main_process:
        shutil.rmtree(args.dirpath, ignore_errors=True)  # the demo starts fresh
    accelerator.wait_for_everyone()
    set_seed(0)
    model, optimizer, scheduler = build(accelerator, args.width)
    uri = f"{args.dirpath}/store"

    t0 = time.perf_counter()
    with attach(accelerator, uri, keep_last=2) as ckpt:  # every process; close() at the end drains
        for _ in range(args.steps // args.every):
            loss = train(accelerator, model, optimizer, scheduler, args.every)
            handle = save_state(accelerator, uri)  # step = ckpt.step; returns at the cut, the rest is background
            blocked = handle.record.blocked_s if accelerator.is_main_process else 0.0
            accelerator.print(f"step {ckpt.step}: loss {loss:.3f}, save blocked {blocked * 1e3:.1f} ms")
        accelerator.save_state(f"{args.dirpath}/final")  # accelerate's call: weights written asynchronously
    accelerator.print(f"trained and checkpointed in {time.perf_counter() - t0:.1f}s")

    if accelerator.is_main_process:
        for gen in CheckpointStore(uri, check_writable=False).generations():
            accelerator.print(f"committed step {gen.step}: {gen.manifest.total_bytes:,} bytes")

    set_seed(1)  # a different init: everything below comes from the checkpoint
    accelerator.free_memory()
    model, optimizer, scheduler = build(accelerator, args.width)
    manifest = load_state(accelerator, uri)
    accelerator.print(f"resumed from step {manifest.step}; scheduler last_lr {scheduler.get_last_lr()}")
    accelerator.load_state(f"{args.dirpath}/final")  # accelerate's own loader reads the hook-path folder too


if __name__ == "__main__":
    main()
