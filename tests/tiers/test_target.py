"""``TieredTarget`` beneath the engine: a drain returns only after the newest commit was handed to the copier and
the replicas, and what they were asked to do ended."""

from __future__ import annotations

import threading

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.tiers.promote import Promoter
from lightning_async_ckpt.tiers.target import TieredTarget


class GatedPromoter(Promoter):
    """A real promoter whose hand-over of each commit waits for ``release`` (the test's gate)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()

    def committed(self, step, *, promote):
        self.entered.set()
        assert self.release.wait(120)
        super().committed(step, promote=promote)


class Replicas:
    """The replicas role, recording what it was handed (no peers in one process)."""

    targets = [1]

    def __init__(self):
        self.replicated: dict[int, list[int]] = {}
        self.on_error = self.on_event = None
        self.closed = False

    def replicate(self, store, step):
        self.replicated[step] = [1]

    def drain(self, timeout=None):
        return True

    def close(self, timeout=None):
        self.closed = True
        return True


def test_drain_returns_only_after_the_newest_commit_reached_the_copier_and_the_replicas(tmp_path):
    local = CheckpointStore(str(tmp_path / "local"))
    durable = CheckpointStore(str(tmp_path / "durable"), run_id=local.run_id)
    copier, replicas = GatedPromoter(local, durable), Replicas()
    target = TieredTarget(local, durable, copier, replicas, every_n_steps=2)
    engine = AsyncCheckpointer(local, target=target)
    target.bind(engine)
    try:
        handle = engine.save(2, {"step": 2})
        assert copier.entered.wait(120)  # committed locally; the hand-over waits at the gate
        assert engine.drain(timeout=0.1) is False
        assert not handle.committed.done() and replicas.replicated == {}
    finally:
        copier.release.set()
    assert engine.drain() is True
    assert replicas.replicated == {2: [1]} and copier.promoted_step == 2
    assert [g.step for g in durable.generations()] == [2]
    engine.close()
    assert replicas.closed


def test_a_save_made_durable_before_its_hand_over_is_promoted(tmp_path):
    local = CheckpointStore(str(tmp_path / "local"))
    durable = CheckpointStore(str(tmp_path / "durable"), run_id=local.run_id)
    copier = GatedPromoter(local, durable)
    target = TieredTarget(local, durable, copier, None, every_n_steps=None)
    engine = AsyncCheckpointer(local, target=target)
    target.bind(engine)
    try:
        engine.save(3, {"step": 3})
        assert copier.entered.wait(120)  # in the hand-over, not durable on the cadence
    finally:
        copier.release.set()
    where = engine.emergency_save(3, {"step": 3}, grace_s=120)
    engine.close()
    assert "promoted step 3" in where and "not in time" not in where
    assert [g.step for g in durable.generations()] == [3]
    assert [g.step for g in local.generations()] == [3]  # promoted, not cut again
