"""StagedCheckpointIO with a real ModelCheckpoint: same files as TorchCheckpointIO, errors once, ordered removals."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_ckpt import CheckpointError, ConfigError
from lightning_async_ckpt.lightning import StagedCheckpointIO
from lightning_async_ckpt.testing import Fault


class _Model(pl.LightningModule):
    """BatchNorm, dropout and Adam; logs ``loss`` so ModelCheckpoint can rank by it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


class _Unpicklable(_Model):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["not_picklable"] = lambda: None  # torch.save fails on the upload thread


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g)), 8)


def _fit(
    model: pl.LightningModule, callbacks: list[Callback], plugins: list[Any] | None, max_steps: int = 8
) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model, _loader())
    return trainer


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_same_files_and_tensors_as_torch_checkpoint_io_with_top_k(tmp_path: Path) -> None:
    results = {}
    for name, plugins in (("torch", None), ("staged", [StagedCheckpointIO()])):
        pl.seed_everything(0)
        mc = ModelCheckpoint(
            dirpath=tmp_path / name, monitor="loss", save_top_k=2, every_n_train_steps=1, filename="{step}-{loss:.4f}"
        )
        trainer = _fit(_Model(), [mc], plugins)
        results[name] = (mc, trainer)
    (mc_t, _), (mc_s, trainer_s) = results["torch"], results["staged"]
    assert _files(tmp_path / "torch") == _files(tmp_path / "staged") and len(_files(tmp_path / "torch")) == 2
    assert Path(mc_t.best_model_path).name == Path(mc_s.best_model_path).name
    for file in _files(tmp_path / "torch"):
        a = torch.load(tmp_path / "torch" / file, weights_only=False)
        b = torch.load(tmp_path / "staged" / file, weights_only=False)
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch", "loops"):
            _assert_same(a[key], b[key])
    plugin = trainer_s.strategy.checkpoint_io
    assert isinstance(plugin, StagedCheckpointIO)
    assert len(plugin.committed) > 2 and all(c.checksum and c.size > 0 for c in plugin.committed)
    # Pooled: the buffers of the first save are reused by the seven later ones.
    assert plugin.pool.allocations < 2 * _slots_of_one_checkpoint(tmp_path / "staged" / _files(tmp_path / "staged")[0])
    # No temp file is left next to the checkpoints.
    assert not [f for f in os.listdir(tmp_path / "staged") if f.startswith(".")]


def _slots_of_one_checkpoint(path: Path) -> int:
    state = torch.load(path, weights_only=False)
    storages = set()

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storages.add(obj.untyped_storage().data_ptr())
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                visit(v)

    visit(state)
    return len(storages)


def test_background_error_is_raised_once_on_the_training_thread_and_leaves_no_file(tmp_path: Path) -> None:
    plugin = StagedCheckpointIO()
    mc = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(CheckpointError, match="was not written") as info:
        _fit(_Unpicklable(), [mc], [plugin])
    assert "step=2" in str(info.value)
    # Raised once: the plugin's teardown (Lightning calls it again on the next fit) has nothing left to raise.
    plugin.teardown()
    assert [f for f in os.listdir(tmp_path) if "step=2" in f] == []


class _UnpicklableThenRaises(_Unpicklable):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 3:
            raise RuntimeError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_a_training_error_is_not_masked_by_a_pending_checkpoint_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mc = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    with caplog.at_level(logging.ERROR, "lightning_async_ckpt"), pytest.raises(RuntimeError, match="user's own"):
        _fit(_UnpicklableThenRaises(), [mc], [StagedCheckpointIO()])
    assert any("was not written" in r.getMessage() for r in caplog.records)


def test_removal_waits_for_the_newer_commit(tmp_path: Path) -> None:
    gate, reached, past_remove = threading.Event(), threading.Event(), threading.Event()
    plugin = StagedCheckpointIO(
        storage_options={
            "target_protocol": "file",
            "faults": [Fault(op="close", path="step=4", stall=gate, callback=lambda call: reached.set())],
        }
    )
    mc = ModelCheckpoint(dirpath=f"faulty://{tmp_path}", every_n_train_steps=2, save_top_k=1)
    errors: list[BaseException] = []
    thread = threading.Thread(target=_fit_catching, args=(mc, plugin, _Watch(5, past_remove), errors), name="fit")
    thread.start()
    try:
        assert reached.wait(60) and past_remove.wait(60)
        # ModelCheckpoint asked to remove step=2 right after requesting step=4; step=4 is not committed yet.
        assert (tmp_path / "epoch=0-step=2.ckpt").exists()
    finally:
        gate.set()
        thread.join(120)
    assert not errors and not thread.is_alive()
    assert _files(tmp_path) == ["epoch=0-step=8.ckpt"]


def test_removal_is_skipped_when_the_newer_save_failed(tmp_path: Path) -> None:
    plugin = StagedCheckpointIO(
        storage_options={
            "target_protocol": "file",
            "faults": [Fault(op="close", path="step=4", error="enospc")],
        }
    )
    mc = ModelCheckpoint(dirpath=f"faulty://{tmp_path}", every_n_train_steps=2, save_top_k=1)
    with pytest.raises(CheckpointError, match="step=4"):
        _fit(_Model(), [mc], [plugin])
    # The checkpoint step=4 was meant to replace is kept: it is the newest one written.
    assert "epoch=0-step=2.ckpt" in _files(tmp_path)
    assert torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=False)["global_step"] == 2


def test_teardown_drains_the_last_write(tmp_path: Path) -> None:
    gate, reached = threading.Event(), threading.Event()
    plugin = StagedCheckpointIO(
        storage_options={
            "target_protocol": "file",
            "faults": [Fault(op="close", path="step=8", stall=gate, callback=lambda call: reached.set())],
        }
    )
    mc = ModelCheckpoint(dirpath=f"faulty://{tmp_path}", every_n_train_steps=4, save_top_k=-1)
    errors: list[BaseException] = []
    thread = threading.Thread(target=_fit_catching, args=(mc, plugin, None, errors), name="fit")
    thread.start()
    try:
        assert reached.wait(60)
        assert thread.is_alive()  # fit cannot return while its last write is outstanding
    finally:
        gate.set()
        thread.join(120)
    assert not errors
    assert torch.load(tmp_path / "epoch=0-step=8.ckpt", weights_only=False)["global_step"] == 8


def test_load_drains_first_and_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    plugin = StagedCheckpointIO()
    try:
        plugin.save_checkpoint({"w": torch.ones(3), "step": 1}, tmp_path / "a.ckpt")
        loaded = plugin.load_checkpoint(tmp_path / "a.ckpt")
        assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(3))
        with pytest.raises(FileNotFoundError):
            plugin.load_checkpoint(tmp_path / "missing.ckpt")
    finally:
        plugin.teardown()
    with pytest.raises(ConfigError, match="max_outstanding"):
        StagedCheckpointIO(max_outstanding=0)
    with pytest.raises(ConfigError, match="storage_options"):
        StagedCheckpointIO(storage_options="endpoint")  # type: ignore[arg-type]


class _Watch(Callback):
    def __init__(self, step: int, event: threading.Event) -> None:
        self.step, self.event = step, event

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.event.set()


def _fit_catching(mc: ModelCheckpoint, plugin: StagedCheckpointIO, watch: Callback | None, errors: list) -> None:
    try:
        _fit(_Model(), [mc] + ([watch] if watch else []), [plugin])
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def test_s3_through_moto_same_files_and_loads_with_storage_options(
    s3_uri: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, options = s3_uri
    # ModelCheckpoint lists and creates folders through its own fsspec lookup, without storage_options: the
    # endpoint comes from the environment for it; the plugin gets it explicitly.
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    plugin = StagedCheckpointIO(storage_options=options)
    mc = ModelCheckpoint(dirpath=uri, every_n_train_steps=2, save_top_k=1)
    _fit(_Model(), [mc], [plugin])
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(uri.removeprefix("s3://")))
    assert names == ["epoch=0-step=8.ckpt"]
    assert [c.size for c in plugin.committed if c.path.endswith("step=8.ckpt")] == [fs.info(mc.best_model_path)["size"]]
    assert plugin.load_checkpoint(mc.best_model_path)["global_step"] == 8
    plugin.teardown()


def test_a_leftover_temp_file_of_a_crashed_run_with_this_pid_is_never_reopened(tmp_path: Path) -> None:
    # Containers restart with the same pid: a crashed run's temp file for the same name must not block (local
    # files are created exclusively) nor be written into (a stalled writer may still hold it).
    leftover = tmp_path / f".epoch=0-step=4.ckpt.tmp-{os.getpid()}"
    leftover.write_bytes(b"a crashed run's partial bytes")
    mc = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=4, save_top_k=-1)
    _fit(_Model(), [mc], [StagedCheckpointIO(retries=0)])
    assert torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=False)["global_step"] == 4
    assert leftover.read_bytes() == b"a crashed run's partial bytes"
