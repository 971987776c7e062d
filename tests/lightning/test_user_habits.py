"""Issue 23: habits ModelCheckpoint users bring (round 3) — the last word, ``last``, arguments, metrics.

Real Trainers, real loggers and real fsspec filesystems; S3 through the moto server of ``conftest.py``.
"""

from __future__ import annotations

import csv
import inspect
import logging
import signal

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.lightning.naming import loadable_path
from lightning_async_ckpt.tools.cli import main
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


def _csv_column(logger: CSVLogger, name: str) -> list[float]:
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def test_the_last_logged_committed_step_is_the_final_one(tmp_path, caplog):
    pl.seed_everything(0)
    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    logger = CSVLogger(tmp_path / "logs")
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_steps=16, logger=logger, log_every_n_steps=1))
    with caplog.at_level(logging.INFO, logger="lightning_async_ckpt"):
        trainer.fit(BNDropoutModel(), make_loader())
    assert cb.committed_step == 16
    assert _csv_column(logger, "ckpt/committed_step")[-1] == 16
    assert int(trainer.progress_bar_metrics["ckpt/committed_step"]) == 16
    assert any("final committed checkpoint step 16" in r.getMessage() for r in caplog.records)


def test_log_metrics_false_logs_no_ckpt_metric(tmp_path):
    pl.seed_everything(0)
    cb = AsyncCheckpointCallback(str(tmp_path / "ckpt"), every_n_train_steps=2, log_metrics=False)
    logger = CSVLogger(tmp_path / "logs")
    trainer = pl.Trainer(callbacks=[cb], **trainer_kwargs(max_steps=6, logger=logger, log_every_n_steps=1))
    trainer.fit(BNDropoutModel(), make_loader())
    assert cb.committed_step == 6
    assert not [k for k in trainer.logged_metrics if k.startswith("ckpt/")]
    assert "ckpt/committed_step" not in trainer.progress_bar_metrics


def test_model_checkpoint_arguments_keep_its_positional_order():
    theirs = list(inspect.signature(ModelCheckpoint.__init__).parameters)[1:]
    params = inspect.signature(AsyncCheckpointCallback.__init__).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
    assert positional == theirs
    # Every argument of the library's own is keyword-only.
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} >= {"keep_last", "storage_options", "ddp_layout"}
    cb = AsyncCheckpointCallback("d", None, None, True)  # meant as verbose=True, as with ModelCheckpoint
    assert cb.verbose is True and cb.save_on_train_end is True
    with pytest.raises(TypeError):
        AsyncCheckpointCallback(
            "d", None, None, True, None, None, False, False, "min", True, 2, None, None, None, True, 3
        )


def _fit(callback, *, max_steps, ckpt_path=None):
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer


def test_last_with_only_weights_only_generations_warns_and_starts_fresh(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    _fit(AsyncCheckpointCallback(dirpath, every_n_train_steps=2, save_weights_only=True), max_steps=4)
    with pytest.warns(UserWarning, match="save_weights_only=True"):
        trainer = _fit(AsyncCheckpointCallback(dirpath, every_n_train_steps=2), max_steps=4, ckpt_path="last")
    assert trainer.ckpt_path is None and trainer.global_step == 4  # trained from step 0, like ModelCheckpoint


def test_a_missing_last_ckpt_in_dirpath_resumes_like_last(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match=r"ckpt_path='last'.*latest_checkpoint"):
        _fit(
            AsyncCheckpointCallback(dirpath, every_n_train_steps=2, save_top_k=-1),
            max_steps=4,
            ckpt_path=f"{dirpath}/last.ckpt",
        )
    _fit(AsyncCheckpointCallback(dirpath, every_n_train_steps=2, save_top_k=-1), max_steps=4)
    cb = AsyncCheckpointCallback(dirpath, every_n_train_steps=2, save_top_k=-1)
    trainer = _fit(cb, max_steps=6, ckpt_path=f"{dirpath}/last.ckpt")  # what resubmit scripts hard-code
    assert trainer.ckpt_path == latest_checkpoint_before(dirpath, 4)
    assert trainer.global_step == 6 and cb.committed_step == 6
    assert sorted(g.step for g in CheckpointStore(dirpath, check_writable=False).generations()) == [2, 4, 6]


def latest_checkpoint_before(dirpath: str, step: int) -> str:
    store = CheckpointStore(dirpath, check_writable=False)
    return loadable_path(store.manifest(step), store)


def test_after_an_s3_resume_ckpt_path_is_the_real_url(s3_uri):
    uri, options = s3_uri
    _fit(AsyncCheckpointCallback(uri, every_n_train_steps=2, storage_options=options), max_steps=4)
    for ckpt_path in ("last", f"{uri}/last.ckpt"):
        cb = AsyncCheckpointCallback(uri, every_n_train_steps=2, storage_options=options)
        trainer = _fit(cb, max_steps=4 if ckpt_path == "last" else 6, ckpt_path=ckpt_path)
        assert str(trainer.ckpt_path).startswith(uri + "/step-")
        assert trainer.ckpt_path == latest_checkpoint(uri, options) or ckpt_path != "last"


# -- the command line on a real run's folder ------------------------------------------------------------------
def _monitored_run(dirpath: str) -> AsyncCheckpointCallback:
    from tests.helpers.selection import fit

    cb = AsyncCheckpointCallback(dirpath, monitor="val_loss", mode="min", save_top_k=-1)
    fit([cb], max_epochs=4)
    return cb


def test_gc_keeps_the_best_generation_unless_asked_and_then_warns(tmp_path, capsys):
    dirpath = str(tmp_path / "ckpt")
    cb = _monitored_run(dirpath)
    steps = [g.step for g in CheckpointStore(dirpath, check_writable=False).generations()]
    best = int(cb.best_model_path.split("step-")[1].split("/")[0])
    assert best != steps[-1], "the test needs a best generation older than the newest"
    assert main(["gc", dirpath, "--keep-last", "1"]) == 0
    out, err = capsys.readouterr()
    assert f"kept the best 1 by val_loss (--keep-best 1): steps [{best}]" in out and "warning" not in err
    left = [g.step for g in CheckpointStore(dirpath, check_writable=False).generations()]
    assert left == sorted({best, steps[-1]})
    assert main(["gc", dirpath, "--keep-last", "1", "--keep-best", "0"]) == 0
    out, err = capsys.readouterr()
    assert f"removed step {best}" in out and "best_model_path" in err


def test_verify_names_the_file_on_disk_and_ls_lists_version_folders(tmp_path, capsys):
    dirpath = str(tmp_path / "ckpt")
    _fit(AsyncCheckpointCallback(dirpath, every_n_train_steps=2), max_steps=4)
    _fit(AsyncCheckpointCallback(dirpath, every_n_train_steps=2), max_steps=4)  # a re-run: writes to v1/
    store = CheckpointStore(dirpath, check_writable=False)
    on_disk = loadable_path(store.manifest(4), store)
    assert main(["verify", dirpath]) == 0
    out, _ = capsys.readouterr()
    assert "step 4: OK (1 objects" in out and on_disk in out
    with open(on_disk, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["verify", dirpath]) == 1
    out, _ = capsys.readouterr()
    assert f"  {on_disk}: checksum" in out and "checkpoint.ckpt" not in out
    assert latest_checkpoint(dirpath).startswith(f"{dirpath}/v1/")
    assert main(["ls", dirpath]) == 0
    out, _ = capsys.readouterr()
    assert f"{dirpath}/v1/step-00000004" in out and "v1/" in out.splitlines()[-1]


# -- plain loops and SIGTERM (what the README says they get) --------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "drain"])
def test_sigterm_in_a_plain_loop_is_what_the_readme_says(tmp_path, mode):
    import sys
    from pathlib import Path

    from tests.helpers.dist import run_script

    worker = Path(__file__).resolve().parents[1] / "helpers" / "sigterm_plain_worker.py"
    proc = run_script([sys.executable, str(worker), str(tmp_path), mode], timeout=120)  # forked from the zygote
    committed = [g.step for g in CheckpointStore(str(tmp_path), check_writable=False).generations()]
    if mode == "default":  # SIGTERM's default action: the process ends at once, nothing drains
        assert proc.returncode == -signal.SIGTERM and committed == [10]
    else:  # the README's handler: SystemExit in the `with` block, whose exit drains the save in flight
        assert proc.returncode == 128 + signal.SIGTERM and committed == [10, 20], proc.stderr[-2000:]


def test_an_s3_checkpoint_loads_outside_a_trainer_with_storage_options_only(s3_uri, monkeypatch):
    """docs/storage.md's recipe, with no credential or endpoint anywhere but in the options."""
    import fsspec
    import s3fs
    import torch

    uri, options = s3_uri
    _fit(AsyncCheckpointCallback(uri, every_n_train_steps=2, storage_options=options), max_steps=4)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    path = latest_checkpoint(uri, storage_options=options)
    with fsspec.open(path, "rb", **options) as f:
        checkpoint = torch.load(f, map_location="cpu", weights_only=True)
    model = BNDropoutModel()
    model.load_state_dict(checkpoint["state_dict"])
    assert checkpoint["global_step"] == 4 and path.endswith("/step-00000004/epoch=0-step=4.ckpt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint["state_dict"].items())


# -- one story on sharded strategies --------------------------------------------------------------------------
def test_the_docs_tell_the_codes_story_on_sharded_strategies():
    from pathlib import Path

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lightning_async_ckpt.lightning.arguments import check_strategy

    check_strategy(ModelParallelStrategy(save_distributed_checkpoint=True))  # accepted by the code ...
    check_strategy(FSDPStrategy(state_dict_type="sharded"))
    root = Path(__file__).resolve().parents[2]
    pages = ["README.md", "docs/comparison.md", "docs/lightning_sharded.md", "docs/troubleshooting.md"]
    for page in pages:  # ... and by every page, which also says what was run where
        text = " ".join((root / page).read_text().split())
        assert 'FSDPStrategy(state_dict_type="sharded")' in text and "ModelParallelStrategy" in text, page
        assert "sharded strategies are refused" not in text and "does not drive it" not in text, page
        low = text.lower()
        assert "gpu" in low and ("not been run" in low or "not run" in low), page
