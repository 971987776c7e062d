"""Resuming from an S3-compatible store whose endpoint and credentials are only in ``storage_options``.

Lightning opens ``ckpt_path`` with its own filesystem lookup, which never sees the callback's ``storage_options``.
These tests clear every ``AWS_*`` credential variable, so only the options can make the moto server reachable.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.errors import ConfigError
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

pytest.importorskip("s3fs")

_CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
)


@pytest.fixture
def options_only(s3_uri, monkeypatch):
    """The bucket of ``s3_uri`` with no credentials or endpoint anywhere but in ``storage_options``."""
    import s3fs

    for name in _CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credential lookup on the network either
    s3fs.S3FileSystem.clear_instance_cache()
    return s3_uri


def _fit(callback, *, max_steps, ckpt_path=None):
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer


def _callback(uri, options):
    return AsyncCheckpointCallback(dirpath=uri, every_n_train_steps=2, storage_options=options, save_top_k=-1)


def test_ckpt_path_last_resumes_with_storage_options_only(options_only):
    uri, options = options_only
    _fit(_callback(uri, options), max_steps=4)
    resumed = _callback(uri, options)
    trainer = _fit(resumed, max_steps=6, ckpt_path="last")
    # Restored at step 4, trained two more steps, and step 6 continued the same run in the same store.
    assert trainer.global_step == 6
    store = CheckpointStore(uri, options, check_writable=False)
    assert [g.step for g in store.generations()] == [2, 4, 6]
    assert len({g.run_id for g in store.generations()}) == 1


@pytest.mark.parametrize("how", ["last", "latest_checkpoint"])
def test_resuming_with_other_intervals_continues_the_run_in_the_bucket(options_only, how):
    # Other intervals change the callback's state key, so Lightning does not restore its state (the run id); the
    # fit resumed from the bucket's newest checkpoint (behind "last", an in-memory marker) and continues that run.
    uri, options = options_only
    first = _callback(uri, options)
    _fit(first, max_steps=4)
    resumed = AsyncCheckpointCallback(dirpath=uri, every_n_train_steps=3, storage_options=options, save_top_k=-1)
    ckpt_path = "last" if how == "last" else latest_checkpoint(uri, options)
    trainer = _fit(resumed, max_steps=6, ckpt_path=ckpt_path)
    assert trainer.global_step == 6 and resumed.run_id == first.run_id
    store = CheckpointStore(uri, options, check_writable=False)
    assert [g.step for g in store.generations()] == [2, 4, 6]
    assert not CheckpointStore(f"{uri}/v1", options, check_writable=False).generations()


def test_latest_checkpoint_resumes_with_storage_options_only(options_only):
    uri, options = options_only
    _fit(_callback(uri, options), max_steps=4)
    path = latest_checkpoint(uri, storage_options=options)
    assert path is not None and path.startswith("s3://") and path.endswith("step-00000004/epoch=0-step=4.ckpt")
    trainer = _fit(_callback(uri, options), max_steps=6, ckpt_path=path)
    assert trainer.global_step == 6
    assert [g.step for g in CheckpointStore(uri, options, check_writable=False).generations()] == [2, 4, 6]


def test_a_missing_bucket_is_found_at_setup_before_any_training(options_only):
    uri, options = options_only
    missing = "s3://lac-no-such-bucket-" + uri.split("/")[2][-8:] + "/ckpt"
    steps = []

    class Counting(BNDropoutModel):
        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(max_steps=4, callbacks=[_callback(missing, options)], **trainer_kwargs())
    with pytest.raises(ConfigError, match="bucket") as info:
        trainer.fit(Counting(), make_loader())
    assert "lac-no-such-bucket" in str(info.value)
    assert steps == []  # found in setup, not at the first save


def test_last_resumes_from_a_model_checkpoint_last_file_in_the_bucket(options_only, tmp_path):
    # A ModelCheckpoint last.ckpt uploaded to the bucket before this callback replaced it: "last" finds it with the
    # callback's storage_options only, and loads it through them.
    import fsspec
    from lightning.pytorch.callbacks import ModelCheckpoint

    uri, options = options_only
    _fit(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True), max_steps=4)
    fs, root = fsspec.core.url_to_fs(uri, **options)
    fs.put_file(str(tmp_path / "last.ckpt"), f"{root}/last.ckpt")
    trainer = _fit(_callback(uri, options), max_steps=6, ckpt_path="last")
    assert trainer.global_step == 6
    store = CheckpointStore(uri, options, check_writable=False)
    assert [g.step for g in store.generations()] == [6]  # resumed at step 4, not from scratch
