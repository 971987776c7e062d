"""What the steps feel: the step slowdown each save caused, against the median step with no save in flight."""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import pytest
import torch

from lightning_async_ckpt import AsyncCheckpointCallback, AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.telemetry import SaveRecord, StepClock
from lightning_async_ckpt.testing import Fault
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


def test_a_period_that_overlaps_a_save_adds_its_excess_over_the_quiet_median():
    clock, record = StepClock(), SaveRecord(requested_step=3)
    for now in (-1.0, 0.0, 1.0, 2.0, 3.1):  # the first period is warm-up; quiet periods 1.0, 1.0, 1.1: median 1.0
        clock.tick(now, [])
    assert clock.quiet_median_s == pytest.approx(1.0)
    clock.tick(4.6, [record], started=True)  # the cut's period: 1.5
    clock.tick(5.8, [record])  # 1.2 while it is in flight
    clock.tick(6.8, [])  # it ended during this period: still charged (0.0)
    clock.tick(7.8, [])  # quiet again
    assert record.slowed_steps == 3
    assert record.step_slowdown_s == pytest.approx(0.5 + 0.2 + 0.0)
    assert clock.quiet_median_s == pytest.approx(1.0)  # the charged periods never became quiet samples


def test_a_save_that_started_and_ended_within_one_period_keeps_it_out_of_the_quiet_median():
    clock = StepClock()
    clock.tick(-1.0, [])
    clock.tick(0.0, [])
    clock.tick(1.0, [])
    clock.tick(9.0, [], started=True)  # a save came and went inside this (slow) period
    assert clock.quiet_median_s == pytest.approx(1.0)


def test_without_a_quiet_step_the_slowdown_is_unknown_not_zero():
    clock, record = StepClock(), SaveRecord(requested_step=1)
    clock.tick(0.0, [record], started=True)
    clock.tick(1.0, [record])
    assert record.slowed_steps == 1
    assert record.step_slowdown_s is None


def test_the_engine_charges_every_step_that_overlapped_a_stalled_save(tmp_path):
    gate, in_flight = threading.Event(), threading.Event()
    fault = Fault(op="open", path=".ckpt", stall=gate, callback=lambda call: in_flight.set())
    store = CheckpointStore(f"faulty://{tmp_path}", {"target_protocol": "file", "faults": [fault]})
    model = torch.nn.Linear(64, 64)
    with AsyncCheckpointer(store) as ckpt:
        for _ in range(3):  # quiet steps: the median
            ckpt.wait(Fence.BATCH_START)
            model(torch.randn(8, 64)).sum().backward()
        handle = ckpt.save(3, {"model": model.state_dict()})
        assert in_flight.wait(30)
        for _ in range(3):  # the upload is held: each of these steps overlaps the save
            ckpt.wait(Fence.BATCH_START)
        gate.set()
        handle.committed.result(timeout=60)
        ckpt.wait(Fence.BATCH_START)  # the period the save ended in is still charged
        ckpt.wait(Fence.BATCH_START)  # quiet again
    record = handle.record
    assert record.slowed_steps == 4
    assert record.step_slowdown_s is not None


def test_the_callback_logs_the_step_slowdown_beside_the_blocked_time(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=8)

    class QuietSteps(pl.Callback):
        """Before the step clock's tick at step 3, lets the pool's fill end: steps 3 to 8 are quiet samples; at step
        10 lets the save of step 8 commit, so its record (with its slowdown) is published at that batch end."""

        lightning_async_ckpt_read_only = True

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:
                assert ours.checkpointer.pool.wait_reserved(timeout=60)
            if trainer.global_step == 10:
                ours.checkpointer.drain_quietly(60)
                assert ours.checkpointer.committed_step == 8

    pl.seed_everything(1)
    trainer = pl.Trainer(max_steps=12, callbacks=[QuietSteps(), ours], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader())
    assert "ckpt/blocked_s" in trainer.callback_metrics
    assert "ckpt/step_slowdown_s" in trainer.callback_metrics


def test_the_first_period_is_warm_up_not_a_quiet_sample():
    # The first step allocates (optimizer state, the allocator's pools, lazy modules): counted as quiet, a slow first
    # step raised the median and made every later save's slowdown negative in a 20-step fit.
    clock, record = StepClock(), SaveRecord(requested_step=4)
    clock.tick(0.0, [])
    clock.tick(5.0, [])  # warm-up
    assert clock.quiet_median_s is None
    clock.tick(6.0, [])
    clock.tick(7.0, [])
    assert clock.quiet_median_s == pytest.approx(1.0)
    clock.tick(8.5, [record], started=True)
    assert record.step_slowdown_s == pytest.approx(0.5)


def test_a_period_with_the_library_s_own_background_work_is_neither_quiet_nor_charged():
    # Filling the staging pool ahead of the first cut takes cores from training too; those steps are no baseline.
    clock, record = StepClock(), SaveRecord(requested_step=6)
    for now in (0.0, 1.0, 2.0, 3.0):
        clock.tick(now, [])
    clock.tick(5.0, [], background=True)  # 2.0: the pool's reservation ran in this period
    clock.tick(7.0, [], background=True)
    assert clock.quiet_median_s == pytest.approx(1.0)
    clock.tick(8.2, [record], started=True)
    assert record.step_slowdown_s == pytest.approx(0.2)
    assert record.slowed_steps == 1


def test_the_engine_keeps_the_pool_reservation_out_of_the_quiet_median(tmp_path):
    reserving, release = threading.Event(), threading.Event()
    store = CheckpointStore(str(tmp_path))
    model = torch.nn.Linear(256, 256)
    with AsyncCheckpointer(store) as ckpt:
        original = ckpt.pool.reserve

        def held_reserve(*args, **kwargs):
            reserving.set()
            assert release.wait(30)
            return original(*args, **kwargs)

        ckpt.pool.reserve = held_reserve
        ckpt.wait(Fence.BATCH_START)
        ckpt.wait(Fence.BATCH_START)  # closes the warm-up period
        reserved = ckpt.preallocate({"model": model.state_dict()}, modules=[model])
        assert reserving.wait(30)
        for _ in range(3):  # the reservation is still running: no quiet sample
            ckpt.wait(Fence.BATCH_START)
        assert ckpt.step_clock.quiet_median_s is None
        release.set()
        reserved.result(timeout=30)
        ckpt.wait(Fence.BATCH_START)  # this period saw the reservation end: not quiet either
        assert ckpt.step_clock.quiet_median_s is None
        ckpt.wait(Fence.BATCH_START)
        assert ckpt.step_clock.quiet_median_s is not None
