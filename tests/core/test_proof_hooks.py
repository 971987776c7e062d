"""Class B of issue 12: the proof's hook tables are derived from Lightning's actual call order.

A real Trainer is walked with a recording callback, LightningModule and datamodule that override every hook name
Lightning defines; this callback marks the cut and its two fences. Every hook seen between the cut and a fence must
be listed in :data:`lightning_async_ckpt.lightning.hooks.WINDOWS` for that window and role, so a Lightning upgrade
that runs a new hook there fails this test instead of silently tearing a checkpoint.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
from torch import nn

from lightning_async_ckpt import AsyncCheckpointCallback
from lightning_async_ckpt.lightning.hooks import WINDOWS, Role, Window
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

EVENTS: list[tuple[str, str]] = []
_SKIP = {"configure_sharded_model", "configure_model"}  # setup-time only; overriding the first one is an error


def _hook_names(*bases: type) -> list[str]:
    return sorted(
        {n for b in bases for n in vars(b) if not n.startswith("_") and callable(getattr(b, n)) and n not in _SKIP}
    )


def _recording(base: type, names: list[str], role: Role) -> type:
    """A subclass of ``base`` whose every hook in ``names`` records ``(role, name)`` and then runs the parent's."""
    cell: list[type] = []

    def make(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            EVENTS.append((role.value, name))
            return getattr(super(cell[0], self), name)(*args, **kwargs)

        hook.__name__ = name
        return hook

    cls = type(f"Recording{base.__name__}", (base,), {n: make(n) for n in names if hasattr(base, n)})
    cell.append(cls)
    return cls


class _Base(BNDropoutModel):
    interval = "step"  # the LR scheduler's interval: "epoch" steps it at epoch ends, between the cut and a fence

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> Any:
        return make_loader(n=64)

    def val_dataloader(self) -> Any:
        return make_loader(n=32, seed=1)


_MODULE_HOOKS = [
    *_hook_names(ModelHooks, DataHooks, CheckpointHooks),
    "forward",
    "training_step",
    "validation_step",
    "backward",
    "clip_gradients",
    "configure_gradient_clipping",
    "lr_scheduler_step",
    "optimizer_step",
    "optimizer_zero_grad",
    "state_dict",
    "load_state_dict",
]
RecordingModule = _recording(_Base, _MODULE_HOOKS, Role.MODULE)
RecordingData = _recording(_Data, [*_hook_names(DataHooks, CheckpointHooks), "state_dict"], Role.DATAMODULE)
RecordingCallback = _recording(Callback, _hook_names(Callback), Role.CALLBACK)
# Checkpoint callbacks are ordered last, keeping their order: this one runs after ours in every hook.
RecordingLaterCallback = _recording(Checkpoint, _hook_names(Callback), Role.LATER_CALLBACK)


class _Marked(AsyncCheckpointCallback):
    """This callback, marking where the cut and the fences really are."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        EVENTS.append(("ours", Window.BEFORE_BATCH_START.value))  # the fence that closes this window
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        EVENTS.append(("ours", Window.BEFORE_OPTIMIZER_STEP.value))
        super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        before = self.requested_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.requested_step != before:
            EVENTS.append(("ours", "cut"))

    def on_train_epoch_end(self, trainer, pl_module):
        before = self.requested_step
        super().on_train_epoch_end(trainer, pl_module)
        if self.requested_step != before:
            EVENTS.append(("ours", "cut"))

    def on_train_end(self, trainer, pl_module):
        EVENTS.append(("ours", "drain"))
        super().on_train_end(trainer, pl_module)


def windows_of(events: list[tuple[str, str]]) -> dict[Window, set[tuple[str, str]]]:
    """Which (role, hook) ran between a cut and the fence (or drain) closing each window."""
    out: dict[Window, set[tuple[str, str]]] = {w: set() for w in Window}
    state: Window | None = None
    for role, name in events:
        if role == "ours":
            if name == "cut":
                state = Window.BEFORE_BATCH_START
            elif name == Window.BEFORE_BATCH_START.value and state is not None:
                state = Window.BEFORE_OPTIMIZER_STEP
            elif name in (Window.BEFORE_OPTIMIZER_STEP.value, "drain"):
                state = None
            continue
        if state is not None:
            out[state].add((role, name))
    return out


CONFIGS = {
    "plain": ({"max_steps": 6}, 2, True),
    "accumulate": ({"max_steps": 6, "accumulate_grad_batches": 2, "val_check_interval": 3}, 1, True),
    "val_mid_epoch": ({"max_steps": 8, "val_check_interval": 3, "limit_val_batches": 2}, 3, True),
    "epochs": (
        {"max_epochs": 3, "limit_train_batches": 5, "limit_val_batches": 2, "reload_dataloaders_every_n_epochs": 1},
        1,
        "epoch",
    ),
    "max_steps_end": ({"max_steps": 5, "limit_val_batches": 2}, 2, True),
    "module_data_hooks": ({"max_steps": 8, "val_check_interval": 3, "limit_val_batches": 2}, 3, False),
    # every_n_train_steps=None: cuts at the end of every epoch (on_train_epoch_end), validation at epoch end.
    "epoch_cuts": ({"max_epochs": 3, "limit_train_batches": 4, "limit_val_batches": 2}, None, True),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_hook_that_runs_between_the_cut_and_a_fence_is_in_the_proof_tables(tmp_path, config):
    args, every, with_datamodule = CONFIGS[config]
    EVENTS.clear()
    pl.seed_everything(1)
    ours = _Marked(dirpath=str(tmp_path), every_n_train_steps=every, every_n_epochs=None if every else 1)
    trainer = pl.Trainer(callbacks=[RecordingCallback(), ours, RecordingLaterCallback()], **trainer_kwargs(**args))
    module = RecordingModule()
    if with_datamodule == "epoch":
        module.interval = "epoch"
    if with_datamodule:
        trainer.fit(module, datamodule=RecordingData())
    else:
        trainer.fit(module, make_loader(n=64), make_loader(n=32, seed=1))
    seen = windows_of(EVENTS)
    assert any(e == ("ours", "cut") for e in EVENTS)
    missing = {
        w.value: sorted(f"{role}.{name}" for role, name in hooks if name not in WINDOWS[w][Role(role)])
        for w, hooks in seen.items()
    }
    assert not any(missing.values()), f"hooks run in a window but missing from the proof tables: {missing}"
