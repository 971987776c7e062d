"""Two tiers in a plain loop: ``TieredCheckpointer`` saves locally and promotes the due generations."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from torch import nn

from lightning_async_ckpt import CheckpointStore, latest_checkpoint
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer


def _steps(path):
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


def _loop(ckpt, steps, *, signal_at=None, start=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt.attach(model, opt)
    for step in range(start, steps + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        if ckpt.preempted:
            ckpt.emergency_save(step, state, grace_s=60)
            return step
        if step % 2 == 0:
            ckpt.save(step, state, modules=[model], optimizers=[opt])
    return steps


def test_plain_loop_promotes_every_due_generation_byte_for_byte_with_retention_per_tier(tmp_path):
    ckpt = TieredCheckpointer(
        str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=4, local_keep_last=2, keep_last=2
    )
    _loop(ckpt, 12)
    ckpt.close()
    assert _steps(tmp_path / "local") == [10, 12]
    assert _steps(tmp_path / "durable") == [8, 12]
    local = CheckpointStore(str(tmp_path / "local"), check_writable=False)
    durable = CheckpointStore(str(tmp_path / "durable"), check_writable=False)
    for step in (12,):
        assert [(o.name, o.size, o.checksum) for o in local.manifest(step).objects] == [
            (o.name, o.size, o.checksum) for o in durable.manifest(step).objects
        ]
        assert durable.verify(step).ok
    found = latest_checkpoint(str(tmp_path / "durable"), local_dirpath=str(tmp_path / "local"))
    assert found == local.object_url(12, "checkpoint.ckpt")


def test_plain_loop_emergency_save_under_a_real_signal(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    ckpt = TieredCheckpointer(
        str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=8, preemption_signal=signal.SIGUSR1
    )
    stopped = _loop(ckpt, 20, signal_at=5)
    ckpt.close()
    assert stopped == 5
    assert _steps(tmp_path / "local") == [2, 4, 5]
    assert _steps(tmp_path / "durable") == [5]
    assert ckpt.promoted_step == 5
    assert not ckpt.preempted  # the emergency save cleared it
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_generation_committed_under_an_attempt_prefix_is_promoted(tmp_path):
    # After a crash the restarted writer finds the dead attempt's claim still leased and commits under its own
    # prefix (w-<token>/): promoting that generation failed ("object file name 'w-.../...' is reserved").
    import subprocess
    import sys

    from lightning_async_ckpt.tiers.promote import promote_generation

    # A writer killed mid-save: its claim on step 4 stays leased (another process, gone without aborting).
    code = "import os, sys; from lightning_async_ckpt import CheckpointStore; CheckpointStore(sys.argv[1]).begin(4); os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "local")], check=True, timeout=120)
    local = CheckpointStore(str(tmp_path / "local"))
    writer = local.begin(4)
    assert writer.prefix.startswith("w-")
    writer.place("checkpoint.ckpt", "epoch=0-step=4.ckpt")
    with writer.open("checkpoint.ckpt") as stream:
        stream.write(b"weights at step 4")
    writer.commit()
    durable = CheckpointStore(str(tmp_path / "durable"))
    manifest = promote_generation(local, durable, 4)
    assert manifest.step == 4 and durable.verify(4).ok
    assert durable.manifest(4).object("checkpoint.ckpt").key == "epoch=0-step=4.ckpt"
    assert durable.open(4, "checkpoint.ckpt").read() == b"weights at step 4"


def test_restore_takes_the_newest_intact_local_generation_else_the_durable_one(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    ckpt = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    _loop(ckpt, 10)  # local 2..10, durable 4, 8
    ckpt.close()
    again = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    restored = again.restore()
    assert (restored.tier, restored.step) == ("local", 10)
    with restored.open() as f:
        assert torch.load(f, weights_only=True)["step"] == 10
    assert again.local.run_id == restored.manifest.run_id  # the restored run continues (retention counts it)
    again.close()
    shutil.rmtree(local)  # a new node
    fresh = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    restored = fresh.restore()
    assert (restored.tier, restored.step) == ("durable", 8)
    fresh.close()


def test_replicas_need_a_process_group(tmp_path):

    with pytest.raises(ConfigError, match="replicas needs torch.distributed"):
        TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), replicas=1)
    with pytest.raises(ConfigError, match="replicas must be None or an int >= 1"):
        TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), replicas=0)


def test_an_emergency_save_right_after_a_local_cut_of_the_same_step_promotes_that_cut(tmp_path):
    ckpt = TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=8)
    _loop(ckpt, 4)  # saves at 2 and 4, local only
    where = ckpt.emergency_save(4, {"step": 4}, grace_s=60)
    ckpt.close()
    assert "promoted step 4" in where
    assert _steps(tmp_path / "local") == [2, 4]
    assert _steps(tmp_path / "durable") == [4]
    durable = CheckpointStore(str(tmp_path / "durable"), check_writable=False)
    assert durable.manifest(4).extra["promoted_from"]["step"] == 4


def test_drain_and_emergency_save_wait_for_a_hand_over_in_progress(tmp_path):
    # The last commit's hand-over (local retention, then its replica) runs on the upload thread. A drain that
    # returned while it ran said "drained" before the replica was queued, and close() then dropped it.
    import threading

    from lightning_async_ckpt.tiers.target import TieredTarget

    entered, release = threading.Event(), threading.Event()
    handed: list[int] = []

    class Handing(TieredTarget):  # where a run with replicas hands the commit to its Replicator
        def committed(self, step, durable):
            super().committed(step, durable)
            entered.set()
            release.wait()
            handed.append(step)

    ckpt = TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=4)
    ckpt.target.__class__ = Handing
    try:
        ckpt.save(2, {"step": 2})
        assert entered.wait(120)  # step 2 committed; its hand-over is in progress
        assert ckpt.drain(timeout=0.2) is False and handed == []
        where = ckpt.emergency_save(2, {"step": 2}, grace_s=0.2)
        assert "not in time" in where and handed == []
    finally:
        release.set()
    assert ckpt.drain() is True and handed == [2]
    ckpt.close()
    assert _steps(tmp_path / "durable") == [2]  # the emergency save promoted the step it found cut already


def test_restore_and_latest_checkpoint_agree_when_the_durable_tier_holds_a_torn_newer_step(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    ckpt = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    _loop(ckpt, 10)  # local 2..10, durable 4, 8
    ckpt.close()
    # A promotion of step 12 killed on the old node: its objects on the durable tier, no manifest.
    torn = durable / CheckpointStore(str(durable), check_writable=False).generation_path(12).rsplit("/", 1)[-1]
    torn.mkdir()
    (torn / "checkpoint.ckpt").write_bytes(b"half a checkpoint")
    again = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    restored = again.restore()
    again.close()
    # Step 12 was never committed: the newest committed generation of either tier is the local step 10.
    assert (restored.tier, restored.step) == ("local", 10)
    found = latest_checkpoint(str(durable), local_dirpath=str(local))
    assert found == restored.store.object_url(10, "checkpoint.ckpt")


def test_two_runs_sharing_a_local_tier_never_resume_each_other(tmp_path):

    shared = str(tmp_path / "local")
    a = TieredCheckpointer(shared, str(tmp_path / "durable-a"), every_n_train_steps=4)
    _loop(a, 4)  # run A: local 2, 4; durable-a 4
    a.close()
    b = TieredCheckpointer(shared, str(tmp_path / "durable-b"), every_n_train_steps=8)
    for step in (6, 8):  # run B, another run, in the same local folder
        b.save(step, {"step": step, "run": "b"})
    b.close()
    run_a = CheckpointStore(str(tmp_path / "durable-a"), check_writable=False).manifest(4).run_id
    again = TieredCheckpointer(shared, str(tmp_path / "durable-a"), every_n_train_steps=4)
    restored = again.restore()
    again.close()
    # A resumes its own newest generation, never B's newer one, and stays run A.
    assert (restored.tier, restored.step) == ("local", 4)
    assert restored.manifest.run_id == run_a and again.local.run_id == run_a
    # A run whose durable tier tells nothing cannot know which of the two runs it continues: refused, naming the fix.
    fresh = TieredCheckpointer(shared, str(tmp_path / "durable-c"))
    with pytest.raises(ConfigError, match="local_dirpath|own local"):
        fresh.restore()
    fresh.close()
    assert _steps(tmp_path / "local") == [2, 4, 6, 8]  # nothing lost


def test_promote_and_durable_name_the_same_choice_and_may_not_disagree(tmp_path):
    ckpt = TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=None)
    model = nn.Linear(4, 4)
    try:
        ckpt.save(1, {"model": model.state_dict()}, promote=True)
        ckpt.save(2, {"model": model.state_dict()}, durable=True, promote=True)
        with pytest.raises(ConfigError, match="durable=False and promote=True disagree"):
            ckpt.save(3, {"model": model.state_dict()}, durable=False, promote=True)
        assert ckpt.drain()
    finally:
        ckpt.close()
    assert [g.step for g in CheckpointStore(str(tmp_path / "durable")).generations()] == [1, 2]


def test_a_run_restored_below_a_newer_local_generation_writes_a_new_local_version_and_keeps_saving(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    ckpt = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    _loop(ckpt, 6)  # local 2, 4, 6; durable 4
    ckpt.close()
    data = next(p for p in (local / "step-00000006").iterdir() if p.name != "manifest.json")
    data.write_bytes(b"damaged")  # the newest local generation no longer verifies
    again = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    restored = again.restore()
    assert (restored.tier, restored.step) == ("local", 4)
    _loop(again, 8, start=5)  # step 6 again: it must not collide with the damaged one
    again.close()
    assert _steps(local / "v1") == [6, 8]
    assert data.read_bytes() == b"damaged"  # the damaged generation is left as it was, never rewritten
    assert _steps(durable) == [4, 8]


@pytest.mark.parametrize("durable", ["tiers", "tiers/durable", "."])
def test_overlapping_local_and_durable_tiers_are_refused_naming_both(tmp_path, durable):
    local = tmp_path / "tiers"
    with pytest.raises(ConfigError, match="overlap"):
        TieredCheckpointer(str(local), str(tmp_path / durable), every_n_train_steps=2)
    assert not [p for p in local.rglob("*") if p.is_file()]  # nothing written
