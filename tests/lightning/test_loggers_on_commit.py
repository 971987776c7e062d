"""Issue 43, point 2: loggers are told of a checkpoint only once it committed, and what they read names committed
files: a failed save is never announced, an S3 ``dirpath`` works the same, and ``CSVLogger`` records only committed
steps as ``ckpt/committed_step``.

TensorBoardLogger, WandbLogger and MLFlowLogger, run offline, are in test_loggers_offline.py.
"""

from __future__ import annotations

import csv

import fsspec
from lightning.pytorch.loggers import CSVLogger, Logger
from typing_extensions import override

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from lightning_async_ckpt.testing import Fault
from tests.helpers.selection import fit


class ManifestCheckingLogger(Logger):
    """A real Lightning logger: at each ``after_save_checkpoint`` it checks, through fsspec, that each file
    ``best_model_path``, ``last_model_path`` and ``best_k_models`` name exists beside its generation's manifest.
    ``strip`` maps a wrapper's URL (``faulty://``) to the folder it wraps."""

    def __init__(self, storage_options: dict | None = None, strip: str = "") -> None:
        super().__init__()
        self.options = storage_options or {}
        self.strip = strip
        self.calls: list[dict] = []

    @property
    @override
    def name(self) -> str:
        return "manifest-checking"

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
        if not isinstance(checkpoint_callback, AsyncCheckpointCallback):
            return
        paths = {checkpoint_callback.best_model_path, checkpoint_callback.last_model_path} - {""}
        paths |= set(getattr(checkpoint_callback, "best_k_models", {}) or {})
        committed = {}
        for path in paths:
            fs, _, (plain,) = fsspec.get_fs_token_paths(path.removeprefix(self.strip), storage_options=self.options)
            folder = plain.rsplit("/", 1)[0]
            committed[path] = fs.exists(f"{folder}/manifest.json") and fs.exists(plain)
        self.calls.append({"committed": committed, "best": checkpoint_callback.best_model_path})


def test_a_failed_save_is_never_announced_to_the_loggers(tmp_path):
    root = str(tmp_path / "ckpt")
    options = {"target_protocol": "file", "faults": [Fault(op="write", path=".ckpt", at=2, error="oserror")]}
    ours = AsyncCheckpointCallback(
        dirpath=f"faulty://{root}", storage_options=options, every_n_train_steps=2, on_error="warn", retries=0
    )
    logger = ManifestCheckingLogger(strip="faulty://")
    fit([ours], max_steps=8, logger=logger)
    steps = [g.step for g in CheckpointStore(root, check_writable=False).generations()]
    assert 0 < len(steps) < 4  # one save failed (never committed), the others committed
    assert len(logger.calls) == len(steps)  # one call per committed generation, none for the failed one
    assert all(c["committed"] and all(c["committed"].values()) for c in logger.calls)
    assert all("step-00000002" not in c["best"] for c in logger.calls)  # the failed step, never named


def test_on_an_s3_dirpath_loggers_are_told_after_the_commit(s3_uri):
    uri, options = s3_uri
    ours = AsyncCheckpointCallback(
        dirpath=uri, storage_options=options, monitor="val_loss", save_top_k=2, every_n_epochs=1
    )
    logger = ManifestCheckingLogger(options)
    fit([ours], max_epochs=3, logger=logger)
    assert len(logger.calls) == len(CheckpointStore(uri, options, check_writable=False).generations()) >= 3
    assert all(c["committed"] and all(c["committed"].values()) for c in logger.calls)
    assert ours.best_model_path.startswith("s3://") and all(p.startswith("s3://") for p in ours.best_k_models)


def test_csv_logger_records_only_committed_steps(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3)
    fit([ours], max_steps=12, logger=CSVLogger(str(tmp_path / "logs")), log_every_n_steps=1)
    with open(next((tmp_path / "logs").rglob("metrics.csv"))) as f:
        logged = {int(float(row["ckpt/committed_step"])) for row in csv.DictReader(f) if row.get("ckpt/committed_step")}
    committed = {g.step for g in CheckpointStore(str(tmp_path / "ckpt"), check_writable=False).generations()}
    assert logged and logged <= committed and max(logged) == max(committed) == 12
