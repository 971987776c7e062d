"""The emergency save: a real signal, sent to this process at a chosen step, asks for a checkpoint now."""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.errors import ConfigError
from tests.helpers.models import (
    BNDropoutModel,
    assert_same,
    load_checkpoint,
    make_loader,
    trainer_kwargs,
    without_model_checkpoint_state,
)


class _SignalAt(Callback):
    """Sends ``signum`` to this process at the end of batch ``step`` (before the checkpoint callback's hook)."""

    def __init__(self, step: int, signum: int, batch_idx: int | None = None) -> None:
        self.step, self.signum, self.batch_idx = step, signum, batch_idx
        self.sent = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.batch_idx in (None, batch_idx) and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def _fit(tmp_path, callbacks, *, max_steps=20):
    pl.seed_everything(7)
    trainer = pl.Trainer(
        max_steps=max_steps, accumulate_grad_batches=2, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(BNDropoutModel(), make_loader())
    return trainer


def _steps(path):
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


@pytest.fixture
def previous_usr1():
    """A Python handler installed before the fit: it must be chained to and restored."""
    calls = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGUSR1, before)


def test_sigusr1_commits_locally_promotes_then_stops_and_restores_the_handler(tmp_path, previous_usr1, caplog):
    installed = signal.getsignal(signal.SIGUSR1)
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "durable"),
        every_n_train_steps=4,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=2,
        preemption_signal=signal.SIGUSR1,
        preemption_grace_s=60,
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with caplog.at_level("WARNING", logger="lightning_async_ckpt"):
        trainer = _fit(tmp_path, [_SignalAt(5, signal.SIGUSR1), ours, sync])

    assert trainer.global_step == 5  # training stopped after the emergency checkpoint
    assert _steps(tmp_path / "local") == [2, 4, 5]
    assert _steps(tmp_path / "durable") == [4, 5]  # step 5 was promoted within the grace period
    local = CheckpointStore(str(tmp_path / "local"), check_writable=False)
    emergency = without_model_checkpoint_state(load_checkpoint(local.object_url(5, "checkpoint.ckpt")))
    assert_same(without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / "step=5.ckpt"))), emergency)
    assert local.manifest(5).plan["rows"] and all(r["fence"] == "cut" for r in local.manifest(5).plan["rows"])
    assert any("emergency checkpoint at step 5" in r.message and "promoted step 5" in r.message for r in caplog.records)
    assert previous_usr1 == [signal.SIGUSR1]  # chained to the handler it replaced
    assert signal.getsignal(signal.SIGUSR1) is installed  # and that one is back
    found = latest_checkpoint(str(tmp_path / "durable"), local_dirpath=str(tmp_path / "local"))
    assert found == local.object_url(5, "checkpoint.ckpt")


def test_sigterm_on_a_single_tier_commits_before_lightning_ends_the_fit(tmp_path):
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    before = signal.signal(signal.SIGTERM, previous)
    try:
        ours = AsyncCheckpointCallback(
            dirpath=str(tmp_path / "ckpt"),
            every_n_train_steps=4,
            preemption_signal=signal.SIGTERM,
            preemption_grace_s=60,
        )
        # Lightning's own SIGTERM handler (installed after setup, calling ours in turn) ends the fit with
        # SIGTERMException once the epoch stops; the emergency checkpoint was committed before.
        with pytest.raises(SystemExit):
            _fit(tmp_path, [_SignalAt(6, signal.SIGTERM), ours])
        assert _steps(tmp_path / "ckpt") == [4, 6]
        assert calls == [signal.SIGTERM]
        # After the exception Lightning puts back the handlers it found (ours among them): a later SIGTERM reaches
        # the previous handler, which is in place again afterwards.
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM, signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, before)


def test_without_preemption_signal_no_handler_is_installed(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    seen = []

    class _Look(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(signal.getsignal(signal.SIGUSR1))

    _fit(tmp_path, [_Look(), AsyncCheckpointCallback(dirpath=str(tmp_path / "c"), every_n_train_steps=4)], max_steps=4)
    assert seen == [before]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preemption_signal": "USR1"}, "preemption_signal"),
        ({"preemption_signal": signal.SIGKILL}, "cannot be caught"),
        ({"preemption_grace_s": -1}, "preemption_grace_s"),
    ],
)
def test_bad_preemption_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AsyncCheckpointCallback(**kwargs)


def test_a_signal_in_the_micro_batch_after_a_local_cut_promotes_that_cut(tmp_path):
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "durable"),
        every_n_train_steps=8,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=2,
        preemption_signal=signal.SIGUSR1,
    )
    # accumulate_grad_batches=2: batch 7 ends optimizer step 4 (a local cut), batch 8 is the next micro-batch, still
    # at step 4: the emergency checkpoint is that cut, promoted now.
    trainer = _fit(tmp_path, [_SignalAt(4, signal.SIGUSR1, batch_idx=8), ours])
    assert trainer.global_step == 4
    assert _steps(tmp_path / "local") == [2, 4]
    assert _steps(tmp_path / "durable") == [4]


def test_a_signal_inside_an_accumulation_window_waits_for_its_end(tmp_path, caplog):
    # accumulate_grad_batches=2: batch 10 is the first micro-batch of step 6 (global_step still 5, not cut). The
    # emergency checkpoint used to be cut at its end as step 5, with batch 10's BatchNorm statistics, loop progress
    # one batch ahead, and its accumulated gradient lost. It is cut at the window's end (step 6) instead.
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, preemption_signal=signal.SIGUSR1, preemption_grace_s=60
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with caplog.at_level("WARNING", logger="lightning_async_ckpt"):
        trainer = _fit(tmp_path, [_SignalAt(5, signal.SIGUSR1, batch_idx=10), sync, ours])
    assert trainer.global_step == 6
    assert _steps(tmp_path / "ckpt") == [4, 6]
    store = CheckpointStore(str(tmp_path / "ckpt"), check_writable=False)
    for step in (4, 6):
        theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={step}.ckpt")))
        assert_same(theirs, without_model_checkpoint_state(load_checkpoint(store.object_url(step, "checkpoint.ckpt"))))
    assert any("accumulation window" in r.getMessage() for r in caplog.records)


def test_with_no_grace_left_inside_an_accumulation_window_no_emergency_checkpoint_is_mislabelled(tmp_path, caplog):
    # preemption_grace_s=0: the window's end cannot be waited for. Training stops without a checkpoint labelled
    # step 5 that holds half of step 6; the log says so (and names the newest committed step).
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, preemption_signal=signal.SIGUSR1, preemption_grace_s=0
    )
    with caplog.at_level("WARNING", logger="lightning_async_ckpt"):
        trainer = _fit(tmp_path, [_SignalAt(5, signal.SIGUSR1, batch_idx=10), ours])
    assert trainer.global_step == 5
    assert _steps(tmp_path / "ckpt") == [4]
    assert any(
        "accumulation window" in r.getMessage() and "no emergency checkpoint" in r.getMessage() for r in caplog.records
    )


@pytest.mark.slow
def test_sigterm_keeps_working_over_fits_ended_normally_by_an_exception_and_by_a_signal(tmp_path):
    # One process, four fits, each with its own callback (a sweep): a fit ended by an exception used to leave a
    # stale handler that killed the process with SIGTERM's default action at the next fit's SIGTERM.
    import sys
    from pathlib import Path

    from tests.helpers.dist import run_script

    worker = Path(__file__).resolve().parents[1] / "helpers" / "sigterm_fits_worker.py"
    proc = run_script([sys.executable, str(worker), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    assert "normal ended normally" in lines and "normal steps [2, 4, 6]" in lines
    assert "exception ended by RuntimeError" in lines and "exception steps [2]" in lines
    for name in ("signal", "signal-again"):
        assert f"{name} ended by SIGTERMException" in lines, lines
        assert f"{name} steps [2, 3]" in lines, lines  # the emergency checkpoint at step 3
    assert "handler after the fits: True" in lines and lines[-1] == "survived"
