"""Storage faults during a run, on local disk and S3 (moto), injected with ``lightning_async_ckpt.testing``.

Transient errors are retried with a bounded, doubling backoff and then commit; persistent ones surface on the
training thread according to ``on_error``; ENOSPC is not retried; storage that stalls times out and is treated
like any other transient error. A failed generation never has a manifest, and what was committed before stays.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_async_ckpt import AsyncCheckpointCallback, AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.testing import Fault
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

STATE = {"w": torch.arange(4096, dtype=torch.float32), "meta": {"lr": 0.1}}


@dataclass
class Backend:
    """A store URL wrapped by the faulty filesystem, and how to read the same data without faults."""

    name: str
    uri: str
    target: dict[str, Any]
    plain_uri: str
    plain_options: dict[str, Any] | None

    def options(self, *faults: Fault, **kwargs: Any) -> dict[str, Any]:
        return {**self.target, "faults": list(faults), **kwargs}

    def store(self, *faults: Fault) -> CheckpointStore:
        return CheckpointStore(self.uri, self.options(*faults))

    def reader(self) -> CheckpointStore:
        return CheckpointStore(self.plain_uri, self.plain_options, check_writable=False)

    def manifests(self) -> list[int]:
        return [g.step for g in self.reader().generations()]

    def folders(self) -> list[int]:
        return [g.step for g in self.reader().generations(include_uncommitted=True)]


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        root = str(tmp_path / "ckpt")
        return Backend("local", f"faulty://{root}", {"target_protocol": "file"}, root, None)
    uri, options = request.getfixturevalue("s3_uri")
    target = {"target_protocol": "s3", "target_options": {**options, "skip_instance_cache": True}}
    return Backend("s3", f"faulty://{uri.removeprefix('s3://')}", target, uri, options)


def _errno_chain(exc: BaseException | None) -> set[int]:
    found = set()
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            found.add(exc.errno)
        exc = exc.__cause__ or exc.__context__
    return found


# -- transient errors -----------------------------------------------------------------------------------------
TRANSIENT = [
    ("open", "checkpoint.ckpt", "oserror"),
    ("write", "checkpoint.ckpt", "oserror"),
    ("write", "checkpoint.ckpt", "timeout"),
    ("write", "checkpoint.ckpt", "connection"),
    ("close", "checkpoint.ckpt", "oserror"),
    ("pipe_file", "manifest.json", "timeout"),
    ("pipe_file", "manifest.json", "oserror"),
    ("cat_file", "manifest.json", "oserror"),  # the committed-step check when a generation begins
]


@pytest.mark.parametrize(("op", "path", "error"), TRANSIENT, ids=[f"{o}-{e}" for o, _, e in TRANSIENT])
def test_transient_error_is_retried_then_committed(backend, op, path, error):
    fault = Fault(op=op, path=path, at=2 if op == "write" else 1, error=error)
    with AsyncCheckpointer(backend.store(fault), retries=2, retry_backoff_s=0.0) as ckpt:
        manifest = ckpt.save(1, STATE).result(timeout=60)
        retries = [e for e in ckpt.events.events if e["event"] == "retry"]
        fired = list(ckpt.store.fs.fired)
    assert isinstance(manifest, Manifest) and manifest.step == 1
    # A timed-out manifest PUT is retried in place, still exclusive, recognising its own bytes if it had landed
    # (storage/throttling.py): the engine's whole-attempt retry is then not needed.
    in_place = (op, error) == ("pipe_file", "timeout")
    assert len(fired) == 1 and [r["attempt"] for r in retries] == ([] if in_place else [1])
    assert backend.manifests() == [1]
    assert backend.reader().verify(1).ok
    loaded = torch.load(backend.reader().open(1, "checkpoint.ckpt"), weights_only=True)
    assert torch.equal(loaded["w"], STATE["w"])


def test_backoff_doubles_and_attempts_are_bounded(tmp_path):
    root = str(tmp_path / "ckpt")
    opts = {"target_protocol": "file"}
    fault = Fault(op="open", path="checkpoint.ckpt", times=3, error="oserror")
    with AsyncCheckpointer(
        CheckpointStore(f"faulty://{root}", {**opts, "faults": [fault]}), retries=3, retry_backoff_s=0.02
    ) as ckpt:
        t0 = time.monotonic()
        assert ckpt.save(1, STATE).result(timeout=60).step == 1
        elapsed = time.monotonic() - t0
        assert ckpt.store.fs.count("open", "checkpoint.ckpt") == 4
        assert [e["attempt"] for e in ckpt.events.events if e["event"] == "retry"] == [1, 2, 3]
    assert elapsed >= 0.02 + 0.04 + 0.08

    # One failure more than the retries allow: exactly retries + 1 attempts, then the save fails.
    fault = Fault(op="open", path="checkpoint.ckpt", times=4, error="oserror")
    ckpt = AsyncCheckpointer(
        CheckpointStore(f"faulty://{root}", {**opts, "faults": [fault]}), retries=3, retry_backoff_s=0.0
    )
    with pytest.raises(CheckpointError, match="injected I/O error"):
        ckpt.save(2, STATE).result(timeout=60)
    assert ckpt.store.fs.count("open", "checkpoint.ckpt") == 4
    with pytest.raises(CheckpointError):
        ckpt.close()
    assert [g.step for g in CheckpointStore(root, check_writable=False).generations()] == [1]


# -- persistent errors ----------------------------------------------------------------------------------------
def test_persistent_error_is_raised_once_on_the_caller_thread(backend):
    fault = Fault(op="write", path="step-00000002", times=None, error="oserror")
    ckpt = AsyncCheckpointer(backend.store(fault), retries=1, retry_backoff_s=0.0, on_error="raise")
    try:
        ckpt.save(1, STATE).result(timeout=60)
        handle = ckpt.save(2, STATE)
        with pytest.raises(CheckpointError, match="injected I/O error"):
            handle.result(timeout=60)
        with pytest.raises(CheckpointError, match="step-00000002"):
            ckpt.save(3, STATE)  # raised at the next call, before anything else happens
        assert ckpt.save(3, STATE).result(timeout=60).step == 3  # raised once, then cleared
    finally:
        ckpt.close()
    assert backend.manifests() == [1, 3]
    assert 2 not in backend.folders()
    assert all(backend.reader().verify(s).ok for s in (1, 3))


def test_persistent_error_with_on_error_warn_keeps_going(backend, caplog):
    fault = Fault(op="pipe_file", path="step-00000002", times=None, error="timeout")
    ckpt = AsyncCheckpointer(backend.store(fault), retries=1, retry_backoff_s=0.0, on_error="warn")
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"), ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, STATE)
            ckpt.drain()
        outcomes = {r.requested_step: r.outcome for r in ckpt.records}
        assert ckpt.committed_step == 3
    assert outcomes == {1: "committed", 2: "failed", 3: "committed"}
    assert any("on_error='warn'" in r.getMessage() and "step-00000002" in r.getMessage() for r in caplog.records)
    assert backend.manifests() == [1, 3]


# -- ENOSPC and stalls ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["open", "write", "pipe_file"])
def test_enospc_is_not_retried(backend, op):
    fault = Fault(op=op, error="enospc", times=None, path="manifest.json" if op == "pipe_file" else "checkpoint.ckpt")
    ckpt = AsyncCheckpointer(backend.store(fault), retries=3, retry_backoff_s=0.0)
    try:
        with pytest.raises(CheckpointError) as info:
            ckpt.save(1, STATE).result(timeout=60)
        assert errno.ENOSPC in _errno_chain(info.value)
        assert ckpt.store.fs.count("open", "checkpoint.ckpt") == 1  # one attempt only
        assert not [e for e in ckpt.events.events if e["event"] == "retry"]
    finally:
        with pytest.raises(CheckpointError):
            ckpt.close()
    assert backend.manifests() == []


def test_stall_until_released_then_commits(backend):
    gate, entered = threading.Event(), threading.Event()
    fault = Fault(op="open", path="checkpoint.ckpt", stall=gate, callback=lambda call: entered.set())
    with AsyncCheckpointer(backend.store(fault)) as ckpt:
        handle = ckpt.save(1, STATE)
        assert entered.wait(30)
        assert not handle.committed.done() and backend.manifests() == []
        gate.set()
        assert handle.result(timeout=60).step == 1
    assert backend.manifests() == [1]


def test_stall_timeout_is_a_transient_error(backend):
    fault = Fault(op="write", path="checkpoint.ckpt", stall=threading.Event(), stall_timeout_s=0.05)
    with AsyncCheckpointer(backend.store(fault), retries=1, retry_backoff_s=0.0) as ckpt:
        assert ckpt.save(1, STATE).result(timeout=60).step == 1
        assert [e["attempt"] for e in ckpt.events.events if e["event"] == "retry"] == [1]
    assert backend.manifests() == [1]


def test_persistent_stall_times_out_and_fails_per_on_error(backend):
    fault = Fault(op="write", path="checkpoint.ckpt", stall=threading.Event(), stall_timeout_s=0.05, times=None)
    ckpt = AsyncCheckpointer(backend.store(fault), retries=1, retry_backoff_s=0.0, on_error="raise")
    with pytest.raises(CheckpointError, match="stall"):
        ckpt.save(1, STATE).result(timeout=60)
    with pytest.raises(CheckpointError, match="stall"):
        ckpt.close()
    assert backend.manifests() == []


# -- acknowledgements lost after the operation took effect ----------------------------------------------------
def test_data_close_acknowledgement_lost_is_retried_without_a_manifest_for_the_failed_attempt(backend):
    fault = Fault(op="close", path="checkpoint.ckpt", error="timeout", after=True)
    with AsyncCheckpointer(backend.store(fault), retries=1, retry_backoff_s=0.0) as ckpt:
        assert ckpt.save(1, STATE).result(timeout=60).step == 1
    assert backend.manifests() == [1] and backend.reader().verify(1).ok


def test_manifest_put_acknowledgement_lost_counts_as_committed(backend):
    # The manifest PUT landed but its response was lost: the retry finds this run's own manifest and must not
    # report a committed generation as failed.
    fault = Fault(op="pipe_file", path="manifest.json", error="timeout", after=True)
    with AsyncCheckpointer(backend.store(fault), retries=2, retry_backoff_s=0.0, keep_last=1) as ckpt:
        assert ckpt.save(1, STATE).result(timeout=60).step == 1
        assert ckpt.committed_step == 1
        assert ckpt.save(2, STATE).result(timeout=60).step == 2
    assert backend.manifests() == [2] and backend.reader().verify(2).ok


# -- through Lightning ----------------------------------------------------------------------------------------
def _fit(backend: Backend, faults: list[Fault], *, max_steps: int, **kwargs: Any) -> tuple[pl.Trainer, Any]:
    pl.seed_everything(7)
    callback = AsyncCheckpointCallback(
        dirpath=backend.uri, storage_options=backend.options(*faults), every_n_train_steps=2, save_top_k=-1, **kwargs
    )
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader())
    return trainer, callback


def test_lightning_on_error_raise_stops_the_fit_at_the_next_hook(backend):
    fault = Fault(op="write", path="step-00000004", times=None, error="oserror")
    trainer = None
    with pytest.raises(CheckpointError, match="step-00000004"):
        trainer, _ = _fit(backend, [fault], max_steps=50, retries=0)
    assert trainer is None
    assert backend.manifests() == [2]
    assert 4 not in backend.folders()
    assert backend.reader().verify(2).ok


def test_lightning_on_error_warn_completes_and_logs(backend, caplog):
    fault = Fault(op="pipe_file", path="step-00000004", times=None, error="oserror")
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        trainer, callback = _fit(backend, [fault], max_steps=8, retries=0, on_error="warn")
    assert trainer.global_step == 8 and callback.committed_step == 8
    assert any("on_error='warn'" in r.getMessage() for r in caplog.records)
    assert backend.manifests() == [2, 6, 8]
    assert all(backend.reader().verify(s).ok for s in (2, 6, 8))


def test_lightning_transient_errors_commit_every_cut(backend):
    faults = [
        Fault(op="write", path="step-00000002", at=5, error="connection"),
        Fault(op="pipe_file", path="step-00000004", error="timeout"),
    ]
    trainer, callback = _fit(backend, faults, max_steps=4, retries=2)
    assert callback.committed_step == 4
    assert backend.manifests() == [2, 4]


# -- the wrapper itself ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"op": "frobnicate", "error": "oserror"}, "Fault.op"),
        ({"op": "write", "at": 0, "error": "oserror"}, "Fault.at"),
        ({"op": "write", "times": 0, "error": "oserror"}, "Fault.times"),
        ({"op": "write", "error": "eperm"}, "Fault.error"),
        ({"op": "write", "stall": object()}, "Fault.stall"),
        ({"op": "write", "stall": threading.Event(), "stall_timeout_s": -1}, "stall_timeout_s"),
        ({"op": "write", "callback": 5}, "Fault.callback"),
        ({"op": "write"}, "would do nothing"),
    ],
)
def test_fault_rejects_bad_plans(kwargs, match):
    from lightning_async_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        Fault(**kwargs)


def test_wrapper_around_an_instance_counts_and_fires_in_order(memory_uri):
    import fsspec

    from lightning_async_ckpt.testing import FaultyFileSystem

    calls = []
    inner = fsspec.filesystem("memory")
    fs = FaultyFileSystem(
        inner,
        faults=[
            Fault(op="pipe_file", at=2, times=2, error="oserror"),
            Fault(op="info", path="b", callback=calls.append, after=True),
        ],
    )
    root = memory_uri.removeprefix("memory://")
    fs.pipe_file(f"{root}/a", b"1")
    for _ in range(2):
        with pytest.raises(OSError, match="injected I/O error"):
            fs.pipe_file(f"{root}/b", b"2")
    fs.pipe_file(f"{root}/b", b"3")
    assert inner.cat_file(f"{root}/b") == b"3"
    assert fs.info(f"{root}/b")["size"] == 1 and [c.op for c in calls] == ["info"]
    assert fs.count("pipe_file") == 4 and fs.count("pipe_file", "/b") == 3
    assert [(c.op, c.count) for c in fs.fired] == [("pipe_file", 2), ("pipe_file", 3), ("info", 1)]


def test_bandwidth_cap_slows_writes(tmp_path):
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"faulty://{tmp_path}/x", bandwidth_bps=64 * 1024)
    t0 = time.monotonic()
    with fs.open(f"{path}/blob", "wb") as f:
        for _ in range(4):
            f.write(b"\0" * 4096)
    assert time.monotonic() - t0 >= 4 * 4096 / (64 * 1024)
    assert (tmp_path / "x" / "blob").stat().st_size == 4 * 4096


def test_fresh_counters_for_every_store_opened_from_the_same_options(tmp_path):
    options = {"target_protocol": "file", "faults": [Fault(op="open", path="checkpoint.ckpt", error="oserror")]}
    for _ in range(2):  # the same plan object: each store's filesystem fails its own first open
        with AsyncCheckpointer(CheckpointStore(f"faulty://{tmp_path}", options), retries=0) as ckpt:
            with pytest.raises(CheckpointError):
                ckpt.save(1, STATE).result(timeout=30)
            with pytest.raises(CheckpointError):
                ckpt.poll()
