"""Issue 43, point 1 in Lightning: ``AsyncCheckpointCallback(on_commit=...)`` and any callback's
``on_checkpoint_committed(trainer, pl_module, committed)``, on the training thread after each commit."""

from __future__ import annotations

import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from lightning_async_ckpt.core.commit_hooks import CommitCallbackError, Committed
from lightning_async_ckpt.errors import ConfigError
from tests.helpers.selection import fit


class Watcher(Callback):
    """A user callback that is told of commits through the method the library calls."""

    def __init__(self) -> None:
        self.seen: list[tuple[Committed, bool, bool]] = []

    def on_checkpoint_committed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, committed: Committed) -> None:
        manifest = Path(committed.uri.removeprefix("file://")) / "manifest.json"
        self.seen.append((committed, threading.current_thread() is threading.main_thread(), manifest.is_file()))
        assert pl_module is trainer.lightning_module


def test_on_commit_and_callbacks_are_told_of_each_commit_once_with_its_best_and_metrics(tmp_path):
    from_arg: list[Committed] = []
    watcher = Watcher()
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path), monitor="val_loss", save_top_k=2, every_n_epochs=1, on_commit=from_arg.append
    )
    fit([ours, watcher], max_epochs=3)

    store = CheckpointStore(str(tmp_path), check_writable=False)
    steps = [g.step for g in store.generations()]
    seen = [c for c, _, _ in watcher.seen]
    assert seen == from_arg  # the same records, in the same order
    assert all(main and manifest for _, main, manifest in watcher.seen)  # training thread, after the manifest
    assert set(steps) <= {c.step for c in seen} and len({c.step for c in seen}) == len(seen)  # once each
    assert all(c.tier == "durable" for c in seen)
    final = seen[-1]
    assert final.is_last and final.step == ours.committed_step
    assert torch.load(final.path, weights_only=False)["global_step"] == final.step
    ranked = [c for c in seen if "val_loss" in c.metrics]
    assert ranked and all(isinstance(v, float) for c in ranked for v in c.metrics.values())
    best = [c for c in seen if c.is_best]
    assert best and best[-1].path == ours.best_model_path  # best as of its delivery, the newest best is the best
    assert min(ranked, key=lambda c: c.metrics["val_loss"]).path == ours.best_model_path


def test_a_raising_on_commit_fails_the_fit_once_and_the_checkpoint_stays(tmp_path):
    def hook(committed: Committed) -> None:
        raise RuntimeError("the model hub is down")

    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, on_commit=hook)
    with pytest.raises(CommitCallbackError, match="the model hub is down"):
        fit([ours], max_steps=6)
    assert [g.step for g in CheckpointStore(str(tmp_path), check_writable=False).generations()]  # committed


def test_on_commit_must_be_callable(tmp_path):
    with pytest.raises(ConfigError, match="on_commit"):
        AsyncCheckpointCallback(dirpath=str(tmp_path), on_commit="print")


def test_with_a_local_tier_the_promotion_is_its_own_event(tmp_path):
    seen: list[Committed] = []
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "durable"),
        local_dirpath=str(tmp_path / "local"),
        every_n_train_steps=4,
        local_every_n_train_steps=2,
        on_commit=seen.append,
    )
    fit([ours], max_steps=8)
    local = {c.step for c in seen if c.tier == "local"}
    durable = {c.step for c in seen if c.tier == "durable"}
    assert {2, 4, 6, 8} <= local and durable == {4, 8}
    durable_store = CheckpointStore(str(tmp_path / "durable"), check_writable=False)
    assert durable == {g.step for g in durable_store.generations()}
    assert all(c.uri.startswith(durable_store.url(c.step)) for c in seen if c.tier == "durable")


def test_export_writes_the_best_and_the_final_generation_as_safetensors_in_the_background(tmp_path):
    from safetensors.torch import load_file

    from lightning_async_ckpt import SafetensorsExport
    from lightning_async_ckpt.core.export import SINGLE_NAME, export_location

    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path),
        monitor="val_loss",
        save_top_k=1,
        every_n_epochs=1,
        export=SafetensorsExport(best=True, dtype="bfloat16"),
    )
    _, model = fit([ours], max_epochs=3)
    exports = CheckpointStore(export_location(str(tmp_path)), check_writable=False)
    exported = [g.step for g in exports.generations()]
    assert ours.committed_step in exported  # the final one
    best_step = int(ours.best_model_path.split("step=")[1].split(".")[0])
    assert best_step in exported  # the best one, when it committed
    final = exports.manifest(ours.committed_step)
    assert final.extra["format"] == "safetensors" and exports.verify(ours.committed_step).ok
    loaded = load_file(f"{exports.generation_path(ours.committed_step)}/{final.object(SINGLE_NAME).key}")
    assert loaded.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            assert loaded[key].dtype == torch.bfloat16 and torch.equal(loaded[key], value.to(torch.bfloat16))
    # The checkpoint store itself lists only its own generations (the exports are a store of their own).
    assert ours.committed_step in [g.step for g in CheckpointStore(str(tmp_path), check_writable=False).generations()]


def test_export_must_be_a_known_format(tmp_path):
    with pytest.raises(ConfigError, match="export"):
        AsyncCheckpointCallback(dirpath=str(tmp_path), export="onnx")
