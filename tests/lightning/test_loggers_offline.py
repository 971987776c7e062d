"""Issue 43, point 2, with Lightning's own loggers run offline: ``WandbLogger`` (W&B's offline mode),
``MLFlowLogger`` (a ``file:`` tracking store) and ``TensorBoardLogger`` (tensorboardX) upload or record exactly the
committed files, never one before its manifest, and upload nothing from an S3 ``dirpath``.

Each logger is the real one, subclassed only to look at what it is told (:class:`CheckedAtUpload`): at every
``after_save_checkpoint`` each file ``best_model_path``, ``last_model_path`` and ``best_k_models`` name is read back
and checked against its generation's manifest (size and checksum) before the logger itself runs. What the logger
then uploaded is read from its own records: the W&B offline run file, MLflow's artifact folders, the event file.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import struct
from pathlib import Path

import fsspec
import pytest
import wandb
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from lightning_async_ckpt.storage.io import read_verified
from tests.helpers.selection import fit, step_of


def md5(data: bytes) -> str:
    """The digest W&B records for a file (base64 of its MD5)."""
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class CheckedAtUpload:
    """Mixed into a real logger: before the logger's own ``after_save_checkpoint`` runs, every file the callback
    names is read and checked against its generation's manifest; ``named`` maps file name -> MD5 of those bytes."""

    storage_options: dict = {}

    @override
    def after_save_checkpoint(self, checkpoint_callback) -> None:
        named = getattr(self, "named", {})
        paths = {checkpoint_callback.best_model_path, checkpoint_callback.last_model_path} - {""}
        for path in paths | set(checkpoint_callback.best_k_models):
            store = CheckpointStore(path.rsplit("/", 2)[0], self.storage_options, check_writable=False)
            manifest = store.manifest(step_of(path))  # raises when the generation has no manifest
            name = path.rsplit("/", 1)[1]
            (entry,) = [o for o in manifest.objects if o.key == name]  # the file is one the manifest lists
            fs, _, (plain,) = fsspec.get_fs_token_paths(path, storage_options=self.storage_options)
            named[name] = md5(read_verified(fs, plain, entry))  # its size and checksum as committed
        self.named = named
        self.calls = getattr(self, "calls", 0) + 1
        super().after_save_checkpoint(checkpoint_callback)


class CheckedWandb(CheckedAtUpload, WandbLogger):
    pass


class CheckedMLFlow(CheckedAtUpload, MLFlowLogger):
    pass


class CheckedTensorBoard(CheckedAtUpload, TensorBoardLogger):
    pass


def top2(dirpath: str, **kw) -> tuple[AsyncCheckpointCallback, list]:
    """A top-2 callback (one save per epoch) and the list its ``on_commit`` hook fills, one record per commit."""
    commits: list = []
    kw.update(monitor="val_loss", save_top_k=2, every_n_epochs=1, on_commit=commits.append)
    return AsyncCheckpointCallback(dirpath=dirpath, **kw), commits


def committed_steps(uri: str, options: dict | None = None) -> list[int]:
    return [g.step for g in CheckpointStore(uri, options, check_writable=False).generations()]


# -- W&B, offline ------------------------------------------------------------------------------------------------
@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B's folders under ``tmp_path``; the run is finished after the test (W&B keeps one run per process)."""
    for name in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path / "wandb-runs"
    wandb.finish()


def wandb_artifacts(save_dir: Path) -> list[dict]:
    """The artifacts an offline run logged, read from its ``run-*.wandb`` file (a LevelDB-style log of protobuf
    records that ``wandb sync`` uploads later): metadata, aliases and the MD5 of each file. Finishes the run and
    stops W&B's service process first: ``finish`` may return before the service wrote the last records."""
    from wandb.proto import wandb_internal_pb2

    wandb.finish()
    wandb.teardown()
    (path,) = glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, record, out, kinds = Path(path).read_bytes(), 7, 32768, b"", [], set()
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        record, pos = (b"" if kind in (1, 2) else record) + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST: a whole record
            parsed = wandb_internal_pb2.Record.FromString(record)
            kinds.add(parsed.WhichOneof("record_type"))
            if parsed.WhichOneof("record_type") == "artifact":
                art = parsed.artifact
                files = {e.path: e.digest for e in art.manifest.contents}
                refs = {e.path: e.ref for e in art.manifest.contents if e.ref}
                out.append({"metadata": json.loads(art.metadata), "files": files, "refs": refs})
    assert "exit" in kinds, f"{path} ends before the run's exit record"
    return out


@pytest.mark.parametrize("log_model", [True, "all"])
def test_wandb_offline_uploads_exactly_the_committed_files(tmp_path, wandb_offline, log_model):
    ours, commits = top2(str(tmp_path / "ckpt"))
    logger = CheckedWandb(save_dir=str(wandb_offline), log_model=log_model, mode="offline", project="lac")
    fit([ours], max_epochs=4, logger=logger)
    uploaded = wandb_artifacts(wandb_offline)
    assert logger.calls == len(commits) >= 3  # once per commit (a cut outside the top 2 is not saved)
    assert uploaded, "the offline run recorded no artifact"
    for artifact in uploaded:  # each upload is a committed file's bytes, checked at the call that named it
        assert artifact["files"] == {"model.ckpt": logger.named[artifact["metadata"]["original_filename"]]}
    names = [a["metadata"]["original_filename"] for a in uploaded]
    if log_model is True:  # at the end of fit: the final top 2
        assert sorted(names) == sorted(p.rsplit("/", 1)[1] for p in ours.best_k_models)
    else:  # each file once, when first named
        assert len(names) == len(set(names)) and set(names) == set(logger.named)


def test_wandb_refuses_lightnings_offline_flag_with_log_model(tmp_path):
    # Lightning's own check: `offline=True` cannot log models; W&B's `mode="offline"` (above) can, for `wandb sync`.
    with pytest.raises(MisconfigurationException, match="offline"):
        WandbLogger(save_dir=str(tmp_path), offline=True, log_model=True)


# -- MLflow, a file: tracking store --------------------------------------------------------------------------------
@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    # MLflow 3 keeps the file store (no database needed) behind this documented opt-in.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def mlflow_uploads(mlruns: Path) -> dict[str, str]:
    """Checkpoint files in the run's artifacts (``<stem>/<file>.ckpt``): file name -> MD5."""
    return {p.name: md5(p.read_bytes()) for p in mlruns.glob("*/*/artifacts/*/*.ckpt")}


@pytest.mark.parametrize("log_model", [True, "all"])
def test_mlflow_uploads_exactly_the_committed_files(tmp_path, mlflow_uri, log_model):
    ours, commits = top2(str(tmp_path / "ckpt"))
    logger = CheckedMLFlow(tracking_uri=mlflow_uri, log_model=log_model)
    fit([ours], max_epochs=4, logger=logger)
    uploaded = mlflow_uploads(tmp_path / "mlruns")
    assert logger.calls == len(commits) >= 3
    assert uploaded and all(digest == logger.named[name] for name, digest in uploaded.items())
    if log_model is True:
        assert set(uploaded) == {p.rsplit("/", 1)[1] for p in ours.best_k_models}
    else:
        assert set(uploaded) == set(logger.named)


# -- TensorBoard (tensorboardX) ------------------------------------------------------------------------------------
def scalars(log_dir: Path, tag: str) -> list[float]:
    """Every value of ``tag`` in the event files (TFRecords: length, its CRC, an Event, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    values = []
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            values += [v.simple_value for v in event.summary.value if v.tag == tag]
    return values


def test_tensorboard_records_only_committed_steps(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    logger = CheckedTensorBoard(save_dir=str(tmp_path / "tb"))
    fit([ours], max_steps=12, logger=logger, log_every_n_steps=1)
    logged = {int(v) for v in scalars(tmp_path / "tb", "ckpt/committed_step")}
    committed = set(committed_steps(str(tmp_path / "ckpt")))
    assert logger.calls == len(committed)
    assert logged and logged <= committed and max(logged) == max(committed) == 12


# -- an S3 dirpath -------------------------------------------------------------------------------------------------
def test_from_an_s3_dirpath_wandb_and_mlflow_upload_nothing(s3_uri, tmp_path, mlflow_uri, wandb_offline):
    # Lightning's upload code reads local files only (`Path(p).is_file()`): an `s3://` path is skipped, the run
    # goes on, and the loggers are still told after each commit (what docs/after_commit.md says).
    uri, options = s3_uri
    ours, commits = top2(uri, storage_options=options)
    mlflow = CheckedMLFlow(tracking_uri=mlflow_uri, log_model="all")
    wandb_logger = CheckedWandb(save_dir=str(wandb_offline), log_model="all", mode="offline", project="lac")
    for logger in (mlflow, wandb_logger):
        logger.storage_options = options  # what CheckedAtUpload reads the named files with
    fit([ours], max_epochs=3, logger=[mlflow, wandb_logger])
    assert mlflow.calls == wandb_logger.calls == len(commits) >= 2
    assert mlflow.named and all(p.startswith("s3://") for p in ours.best_k_models)  # named, committed, on S3
    assert mlflow_uploads(tmp_path / "mlruns") == {}
    assert wandb_artifacts(wandb_offline) == []


def test_from_an_s3_dirpath_an_on_commit_hook_logs_each_committed_generation(s3_uri, wandb_offline, monkeypatch):
    # The way docs/after_commit.md gives for S3: the hook logs the committed folder as a W&B reference artifact
    # (W&B lists the objects with boto3, here from the moto server), manifest.json included.
    uri, options = s3_uri
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])  # for W&B's boto3 client
    logger = WandbLogger(save_dir=str(wandb_offline), mode="offline", project="lac")

    commits = []

    def reference(committed) -> None:
        commits.append(committed)
        artifact = wandb.Artifact("checkpoint", type="model", metadata={"step": committed.step})
        artifact.add_reference(f"{committed.uri}/")  # the folder: its objects, manifest.json included
        logger.experiment.log_artifact(artifact, aliases=["best"] if committed.is_best else [])

    ours = AsyncCheckpointCallback(
        dirpath=uri, storage_options=options, every_n_epochs=1, on_commit=reference, save_top_k=-1
    )
    fit([ours], max_epochs=3, logger=logger)
    logged = {a["metadata"]["step"]: a["refs"] for a in wandb_artifacts(wandb_offline)}
    assert sorted(logged) == [c.step for c in commits]
    for c in commits:  # the checkpoint file and the manifest, both in the committed folder
        assert sorted(logged[c.step].values()) == sorted([c.path, f"{c.uri}/manifest.json"])
