"""Shutdown paths: exceptions and interrupts with a save in flight, interpreter exit, SIGTERM.

Saves are held in flight deterministically: the upload's ``open`` stalls on a ``threading.Event`` through the
faulty filesystem, and the test (or the signal) releases it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from lightning_async_ckpt.testing import Fault
from tests.helpers.dist import run_script
from tests.helpers.forked import start_script
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "crash_worker.py"
REPO = WORKER.parent.parent


class _FailAt(BNDropoutModel):
    """Raises ``fail`` in training_step at step ``at``, once the save requested before it is in flight.

    Set as attributes, not ``__init__`` arguments: those would become hyperparameters, saved in every checkpoint.
    """

    at: int = -1
    fail: BaseException | None = None
    in_flight: threading.Event | None = None

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            assert self.in_flight.wait(30), "the save never reached storage"
            raise self.fail
        return super().training_step(batch, batch_idx)


def _failing_model(at: int, fail: BaseException, in_flight: threading.Event) -> _FailAt:
    model = _FailAt()
    model.at, model.fail, model.in_flight = at, fail, in_flight
    return model


class _ReleaseOnException(pl.Callback):
    """Runs before the checkpoint callback's on_exception (Lightning orders Checkpoint callbacks last)."""

    def __init__(self, gate: threading.Event | None, root: str) -> None:
        self.gate = gate
        self.root = root
        self.committed_at_exception: list[int] | None = None

    def on_exception(self, trainer, pl_module, exception):
        self.committed_at_exception = [g.step for g in CheckpointStore(self.root, check_writable=False).generations()]
        if self.gate is not None:
            self.gate.set()


def _stalled_callback(root: str, gate: threading.Event, in_flight: threading.Event, **kwargs):
    fault = Fault(op="open", path=".ckpt", stall=gate, callback=lambda call: in_flight.set())
    return AsyncCheckpointCallback(
        dirpath=f"faulty://{root}",
        storage_options={"target_protocol": "file", "faults": [fault]},
        every_n_train_steps=2,
        **kwargs,
    )


def _fit(model, callbacks, max_steps=10):
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(model, make_loader())


def _join_checkpoint_threads(timeout: float = 30.0) -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("lightning_async_ckpt"):
            thread.join(timeout)


def test_exception_with_a_save_in_flight_propagates_and_the_save_commits(tmp_path):
    root = str(tmp_path / "ckpt")
    gate, in_flight = threading.Event(), threading.Event()
    release = _ReleaseOnException(gate, root)
    model = _failing_model(3, RuntimeError("boom in training_step"), in_flight)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        _fit(model, [_stalled_callback(root, gate, in_flight), release])
    assert release.committed_at_exception == []  # really in flight when the exception arrived
    store = CheckpointStore(root, check_writable=False)
    assert [g.step for g in store.generations()] == [2]  # drained by on_exception
    assert store.verify(2).ok


def test_exception_with_a_save_that_outlasts_the_drain_bound_leaves_no_manifest(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    gate, in_flight = threading.Event(), threading.Event()
    model = _failing_model(3, RuntimeError("boom"), in_flight)
    callback = _stalled_callback(root, gate, in_flight, drain_timeout_s=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, [callback])
    assert any("abandoned" in r.getMessage() for r in caplog.records)
    gate.set()  # storage answers after the drain gave up: the save must not commit
    _join_checkpoint_threads()
    store = CheckpointStore(root, check_writable=False)
    assert store.generations() == []
    assert [r.outcome for r in callback.checkpointer.records] == ["abandoned"]


def test_keyboard_interrupt_with_a_save_in_flight_drains_it(tmp_path):
    root = str(tmp_path / "ckpt")
    gate, in_flight = threading.Event(), threading.Event()
    release = _ReleaseOnException(gate, root)
    model = _failing_model(3, KeyboardInterrupt(), in_flight)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        # Lightning handles KeyboardInterrupt itself: on_exception, teardown, then sys.exit(1).
        with pytest.raises(SystemExit) as info:
            _fit(model, [_stalled_callback(root, gate, in_flight), release])
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl+C from here on
    assert info.value.code == 1
    assert release.committed_at_exception == []
    store = CheckpointStore(root, check_writable=False)
    assert [g.step for g in store.generations()] == [2] and store.verify(2).ok


def _run_worker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # Forked from the session's zygote (Lightning already imported); it still leaves through interpreter exit.
    return run_script([sys.executable, str(WORKER), *args], timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_interpreter_exit_drains_an_outstanding_save(tmp_path):
    root = str(tmp_path / "ckpt")
    # ~256 KiB at 512 KiB/s: still uploading when main returns without close().
    proc = _run_worker("exit-with-save", root, str(512 * 1024), "60")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REQUESTED outstanding=1 committed=False" in proc.stdout
    assert "interpreter exit: drained 1 outstanding checkpoint save(s)" in proc.stderr
    assert "(complete)" in proc.stderr
    store = CheckpointStore(root, check_writable=False)
    assert [g.step for g in store.generations()] == [1] and store.verify(1).ok


@pytest.mark.slow
def test_interpreter_exit_drain_is_bounded(tmp_path):
    root = str(tmp_path / "ckpt")
    # Storage that never answers: the drain gives up after 0.5 s and the process exits without a manifest.
    proc = _run_worker("exit-with-save", root, "hang", "0.5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REQUESTED outstanding=1 committed=False" in proc.stdout
    assert "timed out, rest abandoned" in proc.stderr
    assert CheckpointStore(root, check_writable=False).generations() == []


@pytest.mark.slow
def test_sigterm_during_a_run_commits_the_save_in_flight_and_exits(tmp_path):
    root = str(tmp_path / "ckpt")
    # Forked from the session zygote (Lightning already imported): a separate process that gets the real signal, runs
    # Lightning's handler and its own, and leaves through interpreter exit.
    with start_script([sys.executable, str(WORKER), "sigterm", root], cwd=REPO) as proc:
        line = proc.readline(timeout=120)
        assert line.startswith("IN_FLIGHT"), (line, proc.stderr[-4000:])
        in_flight = int(line.split("step-")[1].split("/")[0])
        assert CheckpointStore(root, check_writable=False).manifest(2)  # the first save committed
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        out, err = proc.stdout, proc.stderr
    assert "FIT RETURNED" not in out  # SIGTERMException propagated out of fit
    assert "training stopped by SIGTERMException" in err, err[-4000:]
    store = CheckpointStore(root, check_writable=False)
    steps = [g.step for g in store.generations()]
    assert {2, in_flight} <= set(steps), (in_flight, steps)
    assert all(store.verify(s).ok for s in steps)
    assert proc.returncode == 0, err[-4000:]  # SIGTERMException is a SystemExit without a code
