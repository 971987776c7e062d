"""Bad input: invalid arguments, hostile manifests, two runs in one dirpath, unwritable dirpaths.

Every case gives a clear error (naming the parameter, the file or the fix) and nothing committed is lost.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_async_ckpt import (
    AsyncCheckpointCallback,
    AsyncCheckpointer,
    CheckpointStore,
    latest_checkpoint,
)
from lightning_async_ckpt.core.options import CheckpointOptions
from lightning_async_ckpt.errors import (
    CheckpointError,
    ConfigError,
    GenerationExistsError,
    StorageError,
    check_number,
)
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

STATE = {"w": torch.arange(256, dtype=torch.float32)}


# -- constructor arguments ------------------------------------------------------------------------------------
STORE_CASES = [
    ({"uri": ""}, "uri"),
    ({"uri": None}, "uri"),
    ({"uri": 5}, "uri"),
    ({"uri": "nosuchproto://bucket/x"}, "nosuchproto"),
    ({"storage_options": "endpoint=x"}, "storage_options"),
    ({"storage_options": ["a"]}, "storage_options"),
    ({"checksum": "md5"}, "checksum"),
    ({"checksum": 32}, "checksum"),
    ({"block_size": 1024}, "block_size"),
    ({"block_size": "64MiB"}, "block_size"),
    ({"block_size": -1}, "block_size"),
    ({"run_id": 123}, "run_id"),
    ({"run_id": ["a"]}, "run_id"),
    ({"check_writable": "no"}, "check_writable"),
    ({"direct_io": "yes"}, "direct_io"),
    ({"hashed_prefixes": "yes"}, "hashed_prefixes"),
]


@pytest.mark.parametrize(
    ("kwargs", "match"), STORE_CASES, ids=[f"{next(iter(k))}={k[next(iter(k))]!r}" for k, _ in STORE_CASES]
)
def test_checkpoint_store_rejects_bad_arguments(tmp_path, kwargs, match):
    kwargs = {"uri": str(tmp_path), **kwargs}
    with pytest.raises(ConfigError, match=match):
        CheckpointStore(kwargs.pop("uri"), **kwargs)


OPTION_CASES = [
    ("max_outstanding", 0),
    ("max_outstanding", True),
    ("max_outstanding", "1"),
    ("admission", "later"),
    ("admission", None),
    ("host_memory_budget", -1),
    ("host_memory_budget", 0),
    ("host_memory_budget", "lots"),
    ("host_memory_budget", True),
    ("reserved_host_bytes", -1),
    ("reserved_host_bytes", 1.5),
    ("keep_last", 0),
    ("keep_last", True),
    ("keep_last", "2"),
    ("guard", "yes"),
    ("on_error", "ignore"),
    ("retries", -1),
    ("retries", 1.5),
    ("retries", True),
    ("retry_backoff_s", -0.1),
    ("retry_backoff_s", "1s"),
    ("retry_backoff_s", float("nan")),
    ("drain_timeout_s", -1),
    ("drain_timeout_s", None),
    ("drain_timeout_s", float("nan")),
    ("event_log", ""),
    ("event_log", 5),
    ("serializer", object()),
    ("upload_nice", -1),
    ("upload_nice", 20),
    ("upload_nice", "low"),
    ("huge_pages", 1),
]


@pytest.mark.parametrize(("name", "value"), OPTION_CASES, ids=[f"{n}={v!r}" for n, v in OPTION_CASES])
def test_checkpoint_options_and_checkpointer_reject_bad_values(tmp_path, name, value):
    with pytest.raises(ConfigError, match=name):
        CheckpointOptions(**{name: value})
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ConfigError, match=name):
        AsyncCheckpointer(store, **{name: value})
    with pytest.raises(ConfigError, match=name):
        AsyncCheckpointer(store, CheckpointOptions(), **{name: value})


NUMBER_CASES = [
    ({"value": 0, "minimum": 1}, "keep_last must be an int >= 1, got 0"),
    ({"value": True, "minimum": 1}, "keep_last must be an int >= 1, got True"),
    ({"value": 2.0, "minimum": 1}, "keep_last must be an int >= 1, got 2.0"),
    ({"value": None, "minimum": 1}, "keep_last must be an int >= 1, got None"),
    (
        {"value": -1, "optional": True, "hint": " (None keeps all)"},
        "keep_last must be None or an int >= 0 (None keeps all)",
    ),
    ({"value": float("nan"), "integer": False}, "keep_last must be a number >= 0, got nan"),
    ({"value": 0, "integer": False, "above": True}, "keep_last must be a number > 0, got 0"),
    ({"value": float("inf"), "integer": False, "finite": True}, "keep_last must be a finite number >= 0, got inf"),
]


@pytest.mark.parametrize(("kwargs", "message"), NUMBER_CASES, ids=[m for _, m in NUMBER_CASES])
def test_check_number_names_the_parameter_the_bound_and_the_value(kwargs, message):
    with pytest.raises(ConfigError) as info:
        check_number("keep_last", **kwargs)
    assert str(info.value).startswith(message)


def test_check_number_accepts_what_it_names():
    check_number("keep_last", 1, 1)
    check_number("keep_last", None, 1, optional=True)
    check_number("timeout_s", 0.5, integer=False, above=True, finite=True)


@pytest.mark.parametrize("store", [None, 5, object(), ""])
def test_checkpointer_rejects_a_bad_store(store):
    with pytest.raises(ConfigError, match="store|uri"):
        AsyncCheckpointer(store)


def test_checkpointer_rejects_bad_options_and_unknown_overrides(tmp_path):
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ConfigError, match="options"):
        AsyncCheckpointer(store, {"keep_last": 2})
    with pytest.raises(TypeError, match="keep_lats"):
        AsyncCheckpointer(store, keep_lats=2)


def test_checkpointer_rejects_bad_save_arguments(tmp_path):
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as ckpt:
        for step in (-1, True, 1.0, "3"):
            with pytest.raises(ConfigError, match="step"):
                ckpt.save(step, STATE)
    assert CheckpointStore(str(tmp_path)).generations() == []


CALLBACK_CASES = [
    ("dirpath", 5),
    ("dirpath", b"ckpts"),
    ("every_n_train_steps", -2),
    ("every_n_train_steps", 2.0),
    ("every_n_train_steps", True),
    ("every_n_epochs", -1),
    ("every_n_epochs", "1"),
    ("save_on_train_end", "yes"),
    ("keep_last", 0),
    ("admission", "later"),
    ("max_outstanding", 0),
    ("host_memory_budget", -5),
    ("reserved_host_bytes", -1),
    ("defer", 1),
    ("guard", "everything"),
    ("storage_options", "x"),
    ("on_error", "ignore"),
    ("retries", -1),
    ("drain_timeout_s", -1.0),
    ("event_log", ""),
    ("restore_rng", None),
    ("verbose", "loud"),
    ("upload_nice", 25),
    ("huge_pages", "on"),
    # ModelCheckpoint's arguments (issue 15; more cases in tests/lightning/test_modelcheckpoint_args.py)
    ("filename", 5),
    ("monitor", ""),
    ("mode", "avg"),
    ("save_top_k", -2),
    ("save_last", "yes"),
    ("save_weights_only", 1),
    ("auto_insert_metric_name", None),
    ("train_time_interval", 5),
    ("save_on_train_epoch_end", "no"),
    ("enable_version_counter", "x"),
    ("save_on_exception", "yes"),
    ("ddp_layout", "columns"),
    ("log_metrics", "yes"),
    # The local tier and the emergency save (docs/tiers.md)
    ("local_dirpath", 5),
    ("local_dirpath", ""),
    ("local_every_n_train_steps", 0),
    ("local_keep_last", -1),
    ("replicas", 0),
    ("preemption_signal", "NOSUCHSIGNAL"),
    ("preemption_grace_s", -1.0),
    # After the commit (docs/after_commit.md)
    ("on_commit", "print"),
    ("export", "onnx"),
]


@pytest.mark.parametrize(("name", "value"), CALLBACK_CASES, ids=[f"{n}={v!r}" for n, v in CALLBACK_CASES])
def test_callback_rejects_bad_values(name, value):
    with pytest.raises(ConfigError, match=name):
        AsyncCheckpointCallback(**{name: value})


def test_every_callback_argument_is_covered():
    import inspect

    params = set(inspect.signature(AsyncCheckpointCallback.__init__).parameters) - {"self"}
    assert params == {name for name, _ in CALLBACK_CASES}
    store_params = set(inspect.signature(CheckpointStore.__init__).parameters) - {"self"}
    assert store_params == {next(iter(k)) for k, _ in STORE_CASES}
    option_fields = set(CheckpointOptions.__dataclass_fields__)
    assert option_fields == {name for name, _ in OPTION_CASES}


# -- hostile and corrupt manifests ----------------------------------------------------------------------------
def _fit(callbacks, *, max_steps, ckpt_path=None, **kw) -> pl.Trainer:
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=callbacks, **trainer_kwargs(**kw))
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def committed_run(tmp_path_factory) -> Path:
    """A Lightning run that committed steps 2 and 4 (copied per test)."""
    root = tmp_path_factory.mktemp("committed") / "ckpt"
    _fit([AsyncCheckpointCallback(dirpath=str(root), every_n_train_steps=2, save_top_k=-1)], max_steps=4)
    assert [g.step for g in CheckpointStore(str(root), check_writable=False).generations()] == [2, 4]
    return root


@pytest.fixture
def run_dir(committed_run, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(committed_run, dst)
    return dst


def _valid_body(run_dir: Path) -> dict:
    """Step 4's manifest with its checkpoint referenced by name only (the planted copies sit at that name)."""
    body = json.loads((run_dir / "step-00000004" / MANIFEST_NAME).read_text())
    for obj in body["objects"]:
        obj.pop("path", None)
    return body


def _step4_file(run_dir: Path) -> str:
    return CheckpointStore(str(run_dir), check_writable=False).object_url(4, "checkpoint.ckpt")


def _mutate(body: dict, **changes) -> bytes:
    out = json.loads(json.dumps(body))
    for key, value in changes.items():
        if key.startswith("obj_"):
            field = key[4:]
            if value is _DROP:
                del out["objects"][0][field]
            else:
                out["objects"][0][field] = value
        elif value is _DROP:
            del out[key]
        else:
            out[key] = value
    return json.dumps(out).encode()


_DROP = object()
HOSTILE = {
    "path-traversal": lambda b, s: _mutate(b, step=s, obj_name="../step-00000004/checkpoint.ckpt"),
    "file-path-traversal": lambda b, s: _mutate(b, step=s, obj_path="../step-00000004/checkpoint.ckpt"),
    "file-path-absolute": lambda b, s: _mutate(b, step=s, obj_path="/etc/passwd"),
    "absolute-path": lambda b, s: _mutate(b, step=s, obj_name="/etc/passwd"),
    "url-object": lambda b, s: _mutate(b, step=s, obj_name="s3://other-bucket/checkpoint.ckpt"),
    "backslash-traversal": lambda b, s: _mutate(b, step=s, obj_name="..\\..\\checkpoint.ckpt"),
    "absurd-size": lambda b, s: _mutate(b, step=s, obj_size=1 << 62),
    "negative-size": lambda b, s: _mutate(b, step=s, obj_size=-1),
    "size-mismatch": lambda b, s: _mutate(b, step=s, obj_size=b["objects"][0]["size"] + 1),
    "string-step": lambda b, s: _mutate(b, step=str(s)),
    "bool-step": lambda b, s: _mutate(b, step=True),
    "string-size": lambda b, s: _mutate(b, step=s, obj_size="100"),
    "objects-not-a-list": lambda b, s: _mutate(b, step=s, objects={"checkpoint.ckpt": 1}),
    "run-id-not-a-string": lambda b, s: _mutate(b, step=s, run_id=7),
    "missing-objects": lambda b, s: _mutate(b, step=s, objects=_DROP),
    "missing-step": lambda b, s: _mutate(b, step=_DROP),
    "missing-checksum": lambda b, s: _mutate(b, step=s, obj_checksum=_DROP),
    "bad-checksum-format": lambda b, s: _mutate(b, step=s, obj_checksum="md5:abc"),
    "duplicate-objects": lambda b, s: _mutate(b, step=s, objects=b["objects"] * 2),
    "newer-format-version": lambda b, s: _mutate(b, step=s, format_version=99),
    "zero-format-version": lambda b, s: _mutate(b, step=s, format_version=0),
    "foreign-format": lambda b, s: _mutate(b, step=s, format="orbax"),
    "step-of-another-folder": lambda b, s: _mutate(b, step=s - 2),
    "manifest-names-itself": lambda b, s: _mutate(b, step=s, obj_name=MANIFEST_NAME),
    "top-level-list": lambda b, s: b"[]",
    "not-json": lambda b, s: b"{not json",
    "empty": lambda b, s: b"",
    "binary": lambda b, s: bytes(range(256)) * 4,
    "deep-nesting": lambda b, s: b"[" * 200_000,
    "huge-integer": lambda b, s: _mutate(b, step=s).replace(f'"step": {s}'.encode(), b'"step": 1' + b"0" * 5000),
}


def _plant(run_dir: Path, name: str, step: int = 6) -> Path:
    folder = run_dir / f"step-{step:08d}"
    folder.mkdir()
    shutil.copy(_step4_file(run_dir), folder / "checkpoint.ckpt")
    (folder / MANIFEST_NAME).write_bytes(HOSTILE[name](_valid_body(run_dir), step))
    return folder


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_manifest_is_never_trusted_and_loses_nothing(run_dir, name):
    folder = _plant(run_dir, name)
    before = (folder / MANIFEST_NAME).read_bytes()
    assert latest_checkpoint(str(run_dir)) == _step4_file(run_dir)
    store = CheckpointStore(str(run_dir), check_writable=False)
    with pytest.warns(UserWarning, match="step-00000006"):
        assert store.latest().step == 4
    info = {g.step: g for g in store.generations(include_uncommitted=True)}[6]
    if info.committed:  # a well-formed manifest whose object does not match it
        assert store.check_sizes(info.manifest)
    else:
        assert info.error, "the rejection names its reason"
    assert not store.verify(6).ok
    # Retention never trusts it and never removes the committed generations because of it.
    assert 6 not in store.gc(keep_last=1, all_runs=True, dry_run=True)
    assert {2, 4} <= {g.step for g in store.generations()}
    assert all(store.verify(s).ok for s in (2, 4))
    assert (folder / MANIFEST_NAME).read_bytes() == before


def test_resume_past_every_hostile_manifest_at_once(run_dir):
    for i, name in enumerate(sorted(HOSTILE)):
        _plant(run_dir, name, step=6 + 2 * i)
    path = latest_checkpoint(str(run_dir))
    assert path == _step4_file(run_dir)
    trainer = _fit([], max_steps=6, ckpt_path=path, enable_checkpointing=False)
    assert trainer.global_step == 6
    store = CheckpointStore(str(run_dir), check_writable=False)
    assert {2, 4} <= {g.step for g in store.generations()}
    assert all(store.verify(s).ok for s in (2, 4))


def test_a_new_run_does_not_overwrite_a_folder_with_a_rejected_manifest(run_dir):
    _plant(run_dir, "newer-format-version", step=6)
    callback = AsyncCheckpointCallback(dirpath=str(run_dir), every_n_train_steps=2, save_top_k=-1)
    _fit([callback], max_steps=8, ckpt_path=latest_checkpoint(str(run_dir)))
    # The folder holding a manifest this version cannot read is never overwritten, whatever the run decided.
    assert json.loads((run_dir / "step-00000006" / MANIFEST_NAME).read_text())["format_version"] == 99
    store = CheckpointStore(str(run_dir), check_writable=False)
    assert {2, 4} <= {g.step for g in store.generations()} and store.verify(4).ok


@pytest.mark.parametrize("torn", ["empty", "truncated"])
def test_resuming_past_a_torn_manifest_continues_the_run_in_place(run_dir, torn):
    # A crash while a filesystem without atomic puts wrote step 6's manifest leaves a torn one (seen in the crash
    # matrix on faulty://). It never made step 6 recoverable and the writer replaces it, so resuming from the newest
    # committed step continues the run in dirpath: no v1 folder, and step 6 is committed there.
    folder = run_dir / "step-00000006"
    folder.mkdir()
    whole = json.dumps(_valid_body(run_dir)).encode()
    (folder / MANIFEST_NAME).write_bytes(b"" if torn == "empty" else whole[: len(whole) // 2])
    callback = AsyncCheckpointCallback(dirpath=str(run_dir), every_n_train_steps=2, save_top_k=-1)
    _fit([callback], max_steps=8, ckpt_path=latest_checkpoint(str(run_dir)))
    store = CheckpointStore(str(run_dir), check_writable=False)
    assert [g.step for g in store.generations()] == [2, 4, 6, 8]
    assert all(store.verify(s).ok for s in (6, 8))
    assert not [p for p in run_dir.iterdir() if p.name.startswith("v")]


# -- two runs, one dirpath (the decision is made before training: lightning/rerun.py) ---------------------------
def test_second_run_colliding_with_committed_steps_goes_to_a_new_version(run_dir):
    callback = AsyncCheckpointCallback(dirpath=str(run_dir), every_n_train_steps=2, keep_last=1)
    with pytest.warns(UserWarning):
        _fit([callback], max_steps=4)
    store = CheckpointStore(str(run_dir), check_writable=False)
    assert [g.step for g in store.generations()] == [2, 4]
    assert all(store.verify(s).ok for s in (2, 4))
    versions = [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("v")]
    assert len(versions) == 1
    assert [g.step for g in CheckpointStore(str(versions[0]), check_writable=False).generations()] == [4]


def test_second_run_resuming_from_a_copied_folder_continues_there_and_keep_last_applies(run_dir):
    # run_dir is a copy of the first run's folder: the checkpoint names another dirpath, so Lightning does not restore
    # the callback's state (its key holds the dirpath). Resuming from the newest checkpoint there is still that run
    # continuing in place: no collision, and keep_last=1 retires the older generations only once a newer one is
    # committed.
    callback = AsyncCheckpointCallback(dirpath=str(run_dir), every_n_train_steps=2, keep_last=1)
    _fit([callback], max_steps=8, ckpt_path=latest_checkpoint(str(run_dir)))
    store = CheckpointStore(str(run_dir), check_writable=False)
    assert [g.step for g in store.generations()] == [8]
    assert store.verify(8).ok
    assert not [p for p in run_dir.iterdir() if p.name.startswith("v")]
    newest = latest_checkpoint(str(run_dir))
    assert newest is not None and "step-00000008" in newest


def test_two_concurrent_checkpointers_never_overwrite_each_other(tmp_path):
    a = AsyncCheckpointer(CheckpointStore(str(tmp_path)), retries=3, retry_backoff_s=0.0)
    b = AsyncCheckpointer(CheckpointStore(str(tmp_path)), retries=3, retry_backoff_s=0.0, keep_last=1)
    try:
        assert a.save(5, STATE).result(timeout=30).step == 5
        with pytest.raises(GenerationExistsError, match="never overwritten"):
            b.save(5, {"w": torch.zeros(256)}).result(timeout=30)
        assert [e["event"] for e in b.events.events].count("retry") == 0  # not a transient error
        with pytest.raises(CheckpointError):
            b.poll()
        assert b.save(6, STATE).result(timeout=30).step == 6
    finally:
        a.close()
        b.close()
    store = CheckpointStore(str(tmp_path), check_writable=False)
    assert [g.step for g in store.generations()] == [5, 6]
    loaded = torch.load(store.open(5, "checkpoint.ckpt"), weights_only=True)
    assert torch.equal(loaded["w"], STATE["w"])


# -- unwritable dirpath ---------------------------------------------------------------------------------------
def test_dirpath_under_a_regular_file_fails_before_training(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"keep me")
    dirpath = str(blocker / "ckpt")
    with pytest.raises(ConfigError, match="not writable"):
        CheckpointStore(dirpath)
    model = BNDropoutModel()
    steps = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[AsyncCheckpointCallback(dirpath=dirpath, every_n_train_steps=2), Count()],
        **trainer_kwargs(),
    )
    with pytest.raises(ConfigError, match="dirpath .* is not writable"):
        trainer.fit(model, make_loader())
    assert steps == [] and trainer.global_step == 0
    assert blocker.read_bytes() == b"keep me"
    with pytest.raises(StorageError, match="could not list"):
        latest_checkpoint(dirpath)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_dirpath_fails_before_training(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            _fit([AsyncCheckpointCallback(dirpath=str(ro / "ckpt"), every_n_train_steps=2)], max_steps=2)
    finally:
        ro.chmod(0o700)
