"""A small real Accelerate run for the Accelerate tests: a model with every file kind accelerate writes.

``reset_accelerate`` clears accelerate's process-wide singletons so each test (and each "process" of a restart
test) builds a fresh ``Accelerator``; ``tests/accelerate/conftest.py`` applies it around every test there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed

__all__ = ["Counter", "Run", "commit_folder", "make_run", "reset_accelerate", "train"]


class Counter:
    """A custom object registered for checkpointing (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


@dataclass
class Run:
    acc: Accelerator
    model: torch.nn.Module
    opt: Any
    sched: Any
    counter: Counter


def reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_run(seed: int = 0) -> Run:
    """BatchNorm (buffers), dropout (RNG), AdamW (state), StepLR and a custom object: every file accelerate writes."""
    reset_accelerate()
    set_seed(seed)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return Run(acc, model, opt, sched, counter)


def train(run: Run, steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))  # drawn from the RNG that checkpoints restore
        loss = torch.nn.functional.cross_entropy(run.model(x), y)
        run.acc.backward(loss)
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad()
        run.counter.n += 1


def commit_folder(folder: Path, steps: int) -> None:
    """Train ``steps`` steps and commit one folder through the library's Accelerate hook path."""
    from lightning_async_ckpt.accelerate import attach

    run = make_run()
    ckpt = attach(run.acc)
    train(run, steps)
    ckpt.step = steps
    run.acc.save_state(str(folder))
    ckpt.close()
    assert (folder / "manifest.json").exists()
