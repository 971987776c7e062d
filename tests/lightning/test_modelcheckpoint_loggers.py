"""Issue 15, finding 2: ``logger.after_save_checkpoint`` (how W&B and MLflow upload models) is called after each
commit, on the training thread, with a callback exposing what those loggers read."""

from __future__ import annotations

import threading
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.loggers.utilities import _scan_checkpoints
from typing_extensions import override

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests.helpers.models import make_loader, trainer_kwargs
from tests.helpers.selection import ValModel, committed, step_of

# What W&B's _scan_and_log_checkpoints and MLflow's metadata read from the callback.
READ = ("monitor", "mode", "save_last", "save_top_k", "save_weights_only", "dirpath", "best_model_path")
READ += ("best_model_score", "best_k_models", "last_model_path", "current_score", "kth_best_model_path")
READ += ("_every_n_train_steps", "_every_n_epochs", "_train_time_interval")


class RecordingLogger(Logger):
    """A real Lightning logger that records each ``after_save_checkpoint`` call, as W&B/MLflow would see it."""

    def __init__(self, ours: type) -> None:
        super().__init__()
        self.ours = ours
        self.calls: list[dict] = []

    @property
    @override
    def name(self) -> str:
        return "recording"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics, step=None) -> None:
        pass

    @override
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @override
    def after_save_checkpoint(self, checkpoint_callback) -> None:
        if not isinstance(checkpoint_callback, self.ours):
            return  # a weakref.proxy passes isinstance checks of its referent's class
        record = {name: getattr(checkpoint_callback, name) for name in READ}
        record["thread"] = threading.current_thread()
        record["manifest_exists"] = Path(record["best_model_path"]).parent.joinpath("manifest.json").is_file()
        record["scan"] = _scan_checkpoints(checkpoint_callback, {})  # W&B's and MLflow's own scan
        self.calls.append(record)


def test_after_save_checkpoint_is_called_after_each_commit_on_the_training_thread(tmp_path):
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), monitor="val_loss", save_top_k=2, save_last=True)
    logger = RecordingLogger(AsyncCheckpointCallback)
    trainer = pl.Trainer(callbacks=[ours], **trainer_kwargs(max_epochs=4, logger=[logger, CSVLogger(tmp_path)]))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))

    calls = logger.calls
    assert calls, "after_save_checkpoint was never called"
    assert all(c["thread"] is threading.main_thread() for c in calls)
    # Called once the generation it names is committed (its manifest exists), never before.
    assert all(c["manifest_exists"] for c in calls)
    last = calls[-1]
    assert last["monitor"] == "val_loss" and last["mode"] == "min" and last["save_top_k"] == 2
    assert last["best_model_path"] == ours.best_model_path and last["last_model_path"] == ours.last_model_path
    assert last["dirpath"] == str(tmp_path / "async")
    # The scan W&B/MLflow run finds files: every path they read is a loadable file of a committed generation.
    scanned = {p for _, p, _, _ in last["scan"]}
    assert scanned == set(ours.best_k_models) | {ours.last_model_path, ours.best_model_path}
    assert {step_of(p) for p in scanned} <= set(committed(tmp_path / "async"))
    # One call per committed generation; the CSV logger took its calls too (it ignores them) without failing.
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    assert len(calls) >= len(store.generations())


def test_a_model_checkpoint_beside_it_notifies_loggers_as_before(tmp_path):
    pl.seed_everything(3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", monitor="val_loss")
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"))
    theirs_logger = RecordingLogger(ModelCheckpoint)
    trainer = pl.Trainer(callbacks=[ours, sync], **trainer_kwargs(max_epochs=2, logger=theirs_logger))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))
    # ModelCheckpoint's calls and ours both arrive (ours is a ModelCheckpoint subclass, so both are recorded).
    paths = {c["best_model_path"] for c in theirs_logger.calls}
    assert any("sync" in p for p in paths) and any("async" in p for p in paths)


def test_checkpoint_files_are_named_by_the_template_so_mlflow_keeps_one_artifact_each(tmp_path):
    # MLflowLogger uploads each scanned checkpoint to the artifact path `Path(p).stem`: one fixed file name for
    # every generation made each upload overwrite the previous one (the best model was lost from MLflow).
    pl.seed_everything(3)
    args = dict(monitor="val_loss", save_top_k=2, save_last=True)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    ours_log, sync_log = RecordingLogger(AsyncCheckpointCallback), RecordingLogger(ModelCheckpoint)
    trainer = pl.Trainer(callbacks=[sync, ours], **trainer_kwargs(max_epochs=4, logger=[ours_log, sync_log]))
    trainer.fit(ValModel(), make_loader(n=64), make_loader(n=32, seed=1))

    def artifacts(calls) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for call in calls:
            for _, path, _, _ in call["scan"]:
                out.setdefault(Path(path).stem, set()).add(step_of_any(path))
        return out

    mine = artifacts(ours_log.calls)
    assert all(len(steps) == 1 for steps in mine.values()), mine  # one checkpoint per artifact path
    theirs = artifacts([c for c in sync_log.calls if "sync" in str(c["best_model_path"])])
    assert set(mine) == set(theirs) - {"last"}  # ModelCheckpoint's names; "last" is the newest generation here
    assert Path(ours.best_model_path).name == Path(sync.best_model_path).name


def step_of_any(path: str) -> int:
    import re

    found = re.search(r"step[-=]0*(\d+)", path)
    return int(found.group(1)) if found else -1  # ModelCheckpoint's last.ckpt
