"""Two tiers, one cut: every cut committed to a node-local tier, the durable-due ones promoted to ``dirpath``."""

from __future__ import annotations

import shutil
import threading

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.errors import CheckpointError, ConfigError, GenerationExistsError
from lightning_async_ckpt.testing import Fault
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY, Promoter, PromotionError, promote_generation
from tests.helpers.models import (
    BNDropoutModel,
    assert_same,
    load_checkpoint,
    make_loader,
    trainer_kwargs,
    without_model_checkpoint_state,
)


def _fixed_order_loader():
    loader = make_loader()  # the same batches in every epoch: a resumed run sees what an uninterrupted one does
    return DataLoader(loader.dataset, batch_size=8, shuffle=False)


def _fit(callbacks, *, max_steps=8, ckpt_path=None, model=None, root=None, loader=None):
    pl.seed_everything(7)
    model = model or BNDropoutModel()
    kw = trainer_kwargs(default_root_dir=root) if root else trainer_kwargs()
    if not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        kw["enable_checkpointing"] = False
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, callbacks=callbacks, **kw)
    trainer.fit(model, loader or make_loader(), ckpt_path=ckpt_path)
    return trainer, model


def _tiered(tmp_path, **kw):
    args = dict(
        dirpath=str(tmp_path / "durable"),
        every_n_train_steps=4,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=1,
    )
    args.update(kw)
    if "keep_last" not in args and "save_top_k" not in args:
        args["save_top_k"] = -1  # these tests read every promoted generation
    return AsyncCheckpointCallback(**args)


def _steps(path, **kw):
    return [g.step for g in CheckpointStore(str(path), check_writable=False, **kw).generations()]


def _file(path, step, **kw):
    return CheckpointStore(str(path), check_writable=False, **kw).object_url(step, "checkpoint.ckpt")


def test_every_cut_is_local_and_every_durable_due_one_is_promoted_equal_to_model_checkpoints_file(tmp_path):
    ours = _tiered(tmp_path, save_on_train_end=False)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit([ours, sync])

    assert _steps(tmp_path / "local") == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _steps(tmp_path / "durable") == [4, 8]
    local = CheckpointStore(str(tmp_path / "local"), check_writable=False)
    durable = CheckpointStore(str(tmp_path / "durable"), check_writable=False)
    for step in (4, 8):
        promoted, source = durable.manifest(step), local.manifest(step)
        # The same objects, byte for byte (same sizes and checksums), committed with their own manifest.
        assert [(o.name, o.key, o.size, o.checksum) for o in promoted.objects] == [
            (o.name, o.key, o.size, o.checksum) for o in source.objects
        ]
        assert promoted.extra[PROMOTED_FROM_KEY]["step"] == step
        assert durable.verify(step).ok
        with open(_file(tmp_path / "local", step), "rb") as a, durable.open(step, "checkpoint.ckpt") as b:
            assert a.read() == b.read()
    promoted = [e["step"] for e in ours.checkpointer.events.events if e["event"] == "promoted"]
    assert promoted == [4, 8]  # in the event log beside the saves
    for step in range(1, 9):
        theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={step}.ckpt")))
        mine = without_model_checkpoint_state(load_checkpoint(_file(tmp_path / "local", step)))
        assert_same(theirs, mine, f"step{step}")


def test_retention_per_tier(tmp_path):
    ours = _tiered(tmp_path, keep_last=1, local_keep_last=2)
    _fit([ours], max_steps=12)
    assert _steps(tmp_path / "local") == [11, 12]
    assert _steps(tmp_path / "durable") == [12]


def test_without_local_dirpath_nothing_changes(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "d"), every_n_train_steps=4, save_top_k=-1)
    _fit([ours])
    assert _steps(tmp_path / "d") == [4, 8]
    assert ours.tiers is None and ours.preemption.signum is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_every_n_train_steps": 2}, "pass local_dirpath"),
        ({"local_dirpath": "/tmp/x", "local_keep_last": 0}, "local_keep_last"),
        ({"local_dirpath": "/tmp/x", "monitor": "loss"}, "monitor"),
        ({"local_dirpath": "/tmp/x", "every_n_epochs": 1}, "cadence"),
    ],
)
def test_bad_tier_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AsyncCheckpointCallback(**kwargs)


def test_a_failed_promotion_commits_nothing_durable_surfaces_once_and_a_later_resume_works(tmp_path):
    durable_url = f"faulty://{tmp_path / 'durable'}"
    faults = [Fault(op="write", path="step-00000004/epoch=0-step=4.ckpt", error="oserror")]
    ours = _tiered(
        tmp_path,
        dirpath=durable_url,
        storage_options={"target_protocol": "file", "faults": faults},
        local_every_n_train_steps=2,
        save_on_train_end=False,
    )
    with pytest.raises(CheckpointError, match="promoting step 4"):
        _fit([ours], max_steps=8)
    # Step 4's promotion failed after its objects started: no manifest, never listed as committed.
    assert 4 not in _steps(tmp_path / "durable")
    assert CheckpointStore(str(tmp_path / "durable"), check_writable=False).generations() == []
    # The local tier has it; resuming across tiers takes the newest verified generation.
    found = latest_checkpoint(str(tmp_path / "durable"), local_dirpath=str(tmp_path / "local"))
    assert found is not None and str(tmp_path / "local") in found
    _fit([], max_steps=10, ckpt_path=found)


def test_promotion_is_bounded_one_in_flight_and_the_newest_pending(tmp_path):
    source = CheckpointStore(str(tmp_path / "local"))
    for step in (1, 2, 3, 4):
        writer = source.begin(step)
        writer.write_bytes("checkpoint.ckpt", bytes([step]) * 1000)
        writer.commit()
    entered, release = threading.Event(), threading.Event()
    faults = [Fault(op="open", path="step-00000001", callback=lambda call: entered.set(), stall=release)]
    target = CheckpointStore(
        f"faulty://{tmp_path / 'durable'}", {"target_protocol": "file", "faults": faults}, check_writable=False
    )
    errors = []
    promoter = Promoter(source, target, source_keep_last=1, on_error=errors.append)
    promoter.committed(1, promote=True)
    assert entered.wait(30)  # step 1's upload is stalled in the store
    for step in (2, 3, 4):
        promoter.committed(step, promote=True)
    assert promoter.skipped == 2  # 2 and 3 were replaced by the newest pending (4)
    # Local retention keeps the newest one but never the generation being promoted or the pending one.
    assert _steps(tmp_path / "local") == [1, 4]
    release.set()
    assert promoter.close(None)
    assert errors == []
    assert _steps(tmp_path / "durable") == [1, 4]
    assert promoter.promoted_step == 4


def test_promotion_refuses_to_overwrite_and_detects_a_damaged_source(tmp_path):
    source = CheckpointStore(str(tmp_path / "local"))
    target = CheckpointStore(str(tmp_path / "durable"))
    writer = source.begin(5)
    writer.write_bytes("checkpoint.ckpt", b"x" * 4096)
    writer.commit()
    promote_generation(source, target, 5)
    with pytest.raises(GenerationExistsError):
        promote_generation(source, target, 5)
    writer = source.begin(6)
    writer.write_bytes("checkpoint.ckpt", b"y" * 4096)
    writer.commit()
    with open(_file(tmp_path / "local", 6), "r+b") as f:
        f.write(b"z")  # a flipped byte on the local disk
    with pytest.raises(PromotionError, match="step 6"):
        promote_generation(source, target, 6)
    assert _steps(tmp_path / "durable") == [5]
    assert not (tmp_path / "durable" / "step-00000006").exists()  # the aborted writer removed what it wrote


@pytest.mark.parametrize("damage", ["deleted", "damaged", "behind"])
def test_resume_falls_back_to_the_durable_tier(tmp_path, damage):
    _fit([_tiered(tmp_path, local_every_n_train_steps=2, save_on_train_end=False)], max_steps=8)
    local, durable = tmp_path / "local", tmp_path / "durable"
    if damage == "deleted":
        shutil.rmtree(local)
    elif damage == "damaged":
        for step in (6, 8):
            with open(_file(local, step), "r+b") as f:
                f.seek(100)
                f.write(b"\x00\x01\x02")
    else:
        shutil.rmtree(local / "step-00000008")
        shutil.rmtree(local / "step-00000006")
    # Every local generation newer than the durable one is gone or damaged: the durable step 8 is the newest intact.
    if damage == "behind":
        shutil.rmtree(durable / "step-00000004")
    with pytest.warns(UserWarning) if damage == "damaged" else _nothing():
        found = latest_checkpoint(str(durable), local_dirpath=str(local))
    assert found == _file(durable, 8)


def test_resume_prefers_the_newer_local_tier(tmp_path):
    _fit([_tiered(tmp_path, local_every_n_train_steps=2, save_on_train_end=False)], max_steps=10)
    assert _steps(tmp_path / "durable") == [4, 8]
    found = latest_checkpoint(str(tmp_path / "durable"), local_dirpath=str(tmp_path / "local"))
    assert found == _file(tmp_path / "local", 10)


@pytest.mark.parametrize("source", ["local", "durable"])
def test_resume_across_tiers_with_last_continues_like_an_uninterrupted_run(tmp_path, source):
    def callback():
        return _tiered(tmp_path, local_every_n_train_steps=2, save_on_train_end=False, restore_rng=True)

    loader = _fixed_order_loader()
    _, uninterrupted = _fit([], max_steps=16, loader=loader)
    _fit([callback()], max_steps=8, loader=loader)  # the end of the first epoch: nothing of the loader to restore
    assert _steps(tmp_path / "durable") == [4, 8] and 8 in _steps(tmp_path / "local")
    if source == "durable":
        shutil.rmtree(tmp_path / "local")  # the node was lost: resume from step 8 on dirpath
    trainer, resumed = _fit([callback()], max_steps=16, ckpt_path="last", loader=loader)
    assert str(trainer.ckpt_path) == _file(tmp_path / source, 8)
    assert_same(uninterrupted.state_dict(), resumed.state_dict())
    assert _steps(tmp_path / "durable") == [4, 8, 12, 16]
    assert {10, 12, 14, 16} <= set(_steps(tmp_path / "local"))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    "fault",
    [
        Fault(op="open", path="step-00000004/epoch=0-step=4.ckpt", error="oserror"),
        Fault(op="write", path="step-00000004/epoch=0-step=4.ckpt", error="connection", times=None),
        Fault(op="pipe_file", path="step-00000004/manifest.json", error="oserror"),
    ],
    ids=["open", "write", "manifest"],
)
def test_a_promotion_failing_at_any_stage_leaves_no_durable_manifest(tmp_path, fault):
    ours = _tiered(
        tmp_path,
        dirpath=f"faulty://{tmp_path / 'durable'}",
        storage_options={"target_protocol": "file", "faults": [fault]},
        local_every_n_train_steps=2,
        on_error="warn",
    )
    _fit([ours], max_steps=8)
    assert _steps(tmp_path / "durable") == [8]  # step 4 never became committed; step 8 was promoted after it
    assert _steps(tmp_path / "local") == [2, 4, 6, 8]


def test_a_stalled_promotion_never_blocks_training_nor_shows_as_committed(tmp_path):
    entered, release = threading.Event(), threading.Event()
    seen = []
    stall = Fault(
        op="write",
        path="step-00000004/epoch=0-step=4.ckpt",
        callback=lambda call: entered.set(),
        stall=release,
        stall_timeout_s=120,
    )

    class _AtStep8(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 8:
                assert entered.wait(60)
                # Training went on from step 4 to 8 while step 4's upload is stalled in the store. Step 6's local
                # commit may still be in flight here: wait for the local saves (not the promotion) before reading.
                assert ours.checkpointer.drain_quietly(60)
                seen.append((release.is_set(), _steps(tmp_path / "durable"), _steps(tmp_path / "local")))
                release.set()

    ours = _tiered(
        tmp_path,
        dirpath=f"faulty://{tmp_path / 'durable'}",
        storage_options={"target_protocol": "file", "faults": [stall]},
        local_every_n_train_steps=2,
    )
    _fit([_AtStep8(), ours], max_steps=8)
    assert seen == [(False, [], [2, 4, 6])]
    assert _steps(tmp_path / "durable") == [4, 8]


def test_promotion_to_s3_and_resume_from_it_when_the_node_was_lost(s3_uri, tmp_path, monkeypatch):
    uri, options = s3_uri

    def callback():
        return _tiered(tmp_path, dirpath=uri, storage_options=options, local_every_n_train_steps=2)

    _fit([callback()], max_steps=8)
    durable = CheckpointStore(uri, options, check_writable=False)
    local = CheckpointStore(str(tmp_path / "local"), check_writable=False)
    assert [g.step for g in durable.generations()] == [4, 8]
    for step in (4, 8):
        with durable.open(step, "checkpoint.ckpt") as a, local.open(step, "checkpoint.ckpt") as b:
            assert a.read() == b.read()
    shutil.rmtree(tmp_path / "local")
    trainer, _ = _fit([callback()], max_steps=10, ckpt_path="last")
    assert str(trainer.ckpt_path).startswith("s3://") and str(trainer.ckpt_path).endswith("step=8.ckpt")
    assert trainer.global_step == 10
    assert [g.step for g in durable.generations()] == [4, 8, 10]


def test_a_tiered_callback_with_preemption_pickles(tmp_path):
    import copy
    import pickle
    import signal

    ours = _tiered(tmp_path, preemption_signal=signal.SIGUSR1)
    clone = pickle.loads(pickle.dumps(ours))
    assert clone.tiers.local_dirpath == ours.tiers.local_dirpath
    assert clone.preemption.signum == signal.SIGUSR1
    assert copy.deepcopy(ours).local_dirpath == ours.local_dirpath


def test_a_damaged_newer_local_generation_is_never_overwritten_the_run_writes_a_new_local_version(tmp_path):
    def callback():
        return _tiered(tmp_path, local_every_n_train_steps=2, save_on_train_end=False)

    _fit([callback()], max_steps=10)
    with open(_file(tmp_path / "local", 10), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.warns(UserWarning, match="step-00000010"):
        trainer, _ = _fit([callback()], max_steps=12, ckpt_path="last")
    assert str(trainer.ckpt_path) == _file(tmp_path / "local", 8)  # local 8 is intact and as new as dirpath's 8
    assert _steps(tmp_path / "local" / "v1") == [10, 12]  # step 10 of v0 (damaged) was left as it is
    assert _steps(tmp_path / "durable") == [4, 8, 12]
    found = latest_checkpoint(str(tmp_path / "durable"), local_dirpath=str(tmp_path / "local"))
    assert found == _file(tmp_path / "local" / "v1", 12)


def test_an_exception_in_training_lands_the_save_in_flight_locally_then_promotes_it(tmp_path):
    class _Boom(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit([_Boom(), _tiered(tmp_path, local_every_n_train_steps=2)], max_steps=8)
    assert _steps(tmp_path / "local") == [2, 4]
    assert _steps(tmp_path / "durable") == [4]


@pytest.mark.parametrize("stage", ["object", "manifest"])
def test_a_process_killed_while_promoting_leaves_no_durable_generation_and_resumes(tmp_path, stage):
    import sys
    from pathlib import Path

    from tests.helpers.dist import run_script

    worker = Path(__file__).resolve().parents[1] / "helpers" / "promotion_kill_worker.py"
    # Forked from the session's zygote (Lightning imported once): a separate process that os._exit()s mid-promotion.
    proc = run_script([sys.executable, str(worker), str(tmp_path), stage], timeout=300)
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert _steps(tmp_path / "durable") == []  # killed before or while step 4's manifest was written: none
    local = _steps(tmp_path / "local")
    assert 4 in local
    found = latest_checkpoint(str(tmp_path / "durable"), local_dirpath=str(tmp_path / "local"))
    assert found == _file(tmp_path / "local", max(local))
    trainer, _ = _fit([_tiered(tmp_path, local_every_n_train_steps=2)], max_steps=8, ckpt_path="last")
    assert trainer.global_step == 8
    assert _steps(tmp_path / "durable") == [8]


def test_a_run_that_moved_to_a_new_local_version_keeps_writing_there(tmp_path):
    def callback():
        return _tiered(tmp_path, local_every_n_train_steps=2, local_keep_last=1, save_on_train_end=False)

    _fit([callback()], max_steps=10)
    with open(_file(tmp_path / "local", 10), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.warns(UserWarning, match="step-00000010"):
        _fit([callback()], max_steps=12, ckpt_path="last")  # from dirpath's 8 (local 10 damaged): local v1
    _fit([callback()], max_steps=14, ckpt_path="last")  # from local v1's 12: continues in v1, not in v0
    assert _steps(tmp_path / "local" / "v1") == [14]  # local_keep_last=1 in the folder it writes
    assert not (tmp_path / "local" / "v2").exists()
