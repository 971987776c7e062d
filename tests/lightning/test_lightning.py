"""AsyncCheckpointCallback with a real Lightning Trainer on CPU."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, AsyncCheckpointer, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.errors import ConfigError
from tests.helpers.models import (
    BNDropoutModel,
    assert_same,
    load_checkpoint,
    make_loader,
    trainer_kwargs,
    without_model_checkpoint_state,
)

_load = load_checkpoint
_without_model_checkpoint_state = without_model_checkpoint_state


def _fit(tmp_path, callbacks, *, max_steps=8, accumulate=2, model=None, ckpt_path=None, **kw):
    pl.seed_everything(7)
    model = model or BNDropoutModel()
    trainer = pl.Trainer(
        max_steps=max_steps, accumulate_grad_batches=accumulate, callbacks=callbacks, **trainer_kwargs(**kw)
    )
    trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    return trainer, model


def test_committed_checkpoint_equals_model_checkpoint_at_every_step(tmp_path):
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"), every_n_train_steps=2, save_on_train_end=False, save_top_k=-1
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    _fit(tmp_path, [ours, sync])

    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    steps = [g.step for g in store.generations()]
    assert steps == [2, 4, 6, 8]
    for step in steps:
        theirs = _without_model_checkpoint_state(_load(str(tmp_path / "sync" / f"step={step}.ckpt")))
        mine = _without_model_checkpoint_state(_load(store.object_url(step, "checkpoint.ckpt")))
        assert mine["global_step"] == step
        assert_same(theirs, mine, f"step{step}")
    # The deferral really happened: parameters and Adam state were staged after the cut, behind the step fence.
    records = list(ours.checkpointer.records)
    assert ours.committed_step == 8
    plan_fences = {r["category"]: r["fence"] for r in store.manifest(4).plan["rows"]}
    assert plan_fences["parameter"] == Fence.OPTIMIZER_STEP.value
    assert plan_fences["optimizer_state"] == Fence.OPTIMIZER_STEP.value
    assert plan_fences["buffer"] == Fence.BATCH_START.value
    assert [r.requested_step for r in records] == [2, 4, 6, 8]
    assert all(r.outcome == "committed" for r in records)
    # Step 8 ends training: copied at the cut (nothing follows to overlap with); the others deferred.
    assert all(r.deferred_bytes > 0 for r in records[:-1]) and records[-1].deferred_bytes == 0


def test_resuming_from_ours_continues_like_resuming_from_model_checkpoint(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=4, save_on_train_end=False)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    _fit(tmp_path, [ours, sync], max_steps=4)

    path = latest_checkpoint(str(tmp_path / "async"))
    assert path is not None and path.endswith("step-00000004/epoch=0-step=4.ckpt")
    _, from_ours = _fit(tmp_path, [], max_steps=10, ckpt_path=path, enable_checkpointing=False)
    _, from_sync = _fit(
        tmp_path, [], max_steps=10, ckpt_path=str(tmp_path / "sync" / "step=4.ckpt"), enable_checkpointing=False
    )
    assert_same(from_sync.state_dict(), from_ours.state_dict())


def test_defer_false_copies_everything_at_the_cut(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, defer=False, save_on_train_end=False)
    _fit(tmp_path, [ours], max_steps=4)
    rows = CheckpointStore(str(tmp_path), check_writable=False).manifest(4).plan["rows"]
    assert {r["fence"] for r in rows} == {"cut"}


class _WritesAfterBackward(BNDropoutModel):
    def on_after_backward(self):
        pass


class _Manual(BNDropoutModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return loss


@pytest.mark.parametrize("model_cls", [_WritesAfterBackward, _Manual])
def test_unproven_deferral_falls_back_to_batch_start_and_stays_equivalent(tmp_path, model_cls):
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "async"), every_n_train_steps=2, save_on_train_end=False, save_top_k=-1
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    _fit(tmp_path, [ours, sync], max_steps=4, accumulate=1, model=model_cls())
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    manifest = store.manifest(2)  # step 4 ends training: copied at the cut
    fences = {r["category"]: r["fence"] for r in manifest.plan["rows"]}
    assert fences["parameter"] == "batch_start"
    assert manifest.plan["failures"]
    assert_same(
        _without_model_checkpoint_state(_load(str(tmp_path / "sync" / "step=4.ckpt"))),
        _without_model_checkpoint_state(_load(store.object_url(4, "checkpoint.ckpt"))),
    )


def test_progress_is_logged_and_committed_step_is_in_the_progress_bar(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)
    trainer, _ = _fit(tmp_path, [ours], max_steps=6, accumulate=1)
    assert trainer.callback_metrics["ckpt/requested_step"] >= 4
    assert "ckpt/committed_step" in trainer.progress_bar_metrics
    assert ours.committed_step == 6 and ours.requested_step == 6


def test_exception_in_training_step_drains_the_save_in_flight(tmp_path):
    class Boom(BNDropoutModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 5:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=4)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, [ours], max_steps=10, accumulate=1, model=Boom())
    store = CheckpointStore(str(tmp_path), check_writable=False)
    assert [g.step for g in store.generations()] == [4]
    assert store.verify(4).ok


def test_second_fit_with_a_new_trainer_resumes_and_keeps_retention(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=2)
    trainer, model = _fit(tmp_path, [ours], max_steps=4, accumulate=1)
    trainer2 = pl.Trainer(max_steps=8, callbacks=[ours], **trainer_kwargs())
    trainer2.fit(model, make_loader(), ckpt_path=latest_checkpoint(str(tmp_path)))
    store = CheckpointStore(str(tmp_path), check_writable=False)
    assert [g.step for g in store.generations()] == [6, 8]
    assert ours.committed_step == 8


def test_validate_between_fits_does_not_break(tmp_path):
    class WithVal(BNDropoutModel):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", super().training_step(batch, batch_idx))

    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)
    model = WithVal()
    trainer = pl.Trainer(max_steps=4, callbacks=[ours], limit_val_batches=2, **trainer_kwargs())
    trainer.fit(model, make_loader(), make_loader())
    trainer.validate(model, make_loader(), verbose=False)
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(model, make_loader(), make_loader())
    assert [g.step for g in CheckpointStore(str(tmp_path), check_writable=False).generations()] == [2, 4, 6, 8]


def test_new_run_into_a_dirpath_with_committed_steps_writes_a_new_version(tmp_path):
    # Decided before training (tests/lightning/test_rerun.py): the earlier run's generations are never touched or mixed.
    _fit(tmp_path, [AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)], max_steps=2, accumulate=1)
    with pytest.warns(UserWarning, match="v1"):
        _fit(
            tmp_path, [AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)], max_steps=2, accumulate=1
        )
    assert CheckpointStore(str(tmp_path), check_writable=False).verify(2).ok
    assert [g.step for g in CheckpointStore(str(tmp_path / "v1"), check_writable=False).generations()] == [2]


def test_latest_checkpoint_ignores_uncommitted_generations(tmp_path):
    _fit(tmp_path, [AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)], max_steps=4, accumulate=1)
    store = CheckpointStore(str(tmp_path))
    writer = store.begin(6)
    writer.write_bytes("checkpoint.ckpt", b"half")
    assert "/step-00000004/" in latest_checkpoint(str(tmp_path))
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None


def test_latest_checkpoint_and_resume_on_s3(s3_uri, tmp_path, monkeypatch):
    uri, options = s3_uri
    ours = AsyncCheckpointCallback(dirpath=uri, every_n_train_steps=2, storage_options=options)
    _fit(tmp_path, [ours], max_steps=4, accumulate=1)
    path = latest_checkpoint(uri, storage_options=options)
    assert path is not None and path.startswith("s3://") and path.endswith("step-00000004/epoch=0-step=4.ckpt")
    assert _load(path, options)["global_step"] == 4
    # Lightning's own loader has no storage options: resume from a custom endpoint through the environment.
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    s3fs.S3FileSystem.clear_instance_cache()
    trainer, _ = _fit(tmp_path, [], max_steps=6, accumulate=1, ckpt_path=path, enable_checkpointing=False)
    assert trainer.global_step == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_train_steps": -1}, "every_n_train_steps"),
        ({"every_n_train_steps": 1.5}, "every_n_train_steps"),
        ({"every_n_epochs": -1}, "every_n_epochs"),
        ({"admission": "later"}, "admission"),
        ({"max_outstanding": 0}, "max_outstanding"),
        ({"keep_last": 0}, "keep_last"),
        ({"host_memory_budget": -5}, "host_memory_budget"),
        ({"dirpath": 5}, "dirpath"),
        ({"defer": "yes"}, "defer"),
        ({"storage_options": "x"}, "storage_options"),
        ({"on_error": "ignore"}, "on_error"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AsyncCheckpointCallback(**kwargs)


def test_budget_too_small_fails_before_training(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, host_memory_budget=1024)
    with pytest.raises(Exception, match="host_memory_budget"):
        _fit(tmp_path, [ours], max_steps=2)
    assert CheckpointStore(str(tmp_path), check_writable=False).generations() == []


def test_resumed_run_keeps_the_run_id_so_retention_reaches_across_restarts(tmp_path):
    first = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=2)
    _fit(tmp_path, [first], max_steps=6, accumulate=1)
    second = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=2)
    _fit(tmp_path, [second], max_steps=10, accumulate=1, ckpt_path=latest_checkpoint(str(tmp_path)))
    store = CheckpointStore(str(tmp_path), check_writable=False)
    gens = store.generations()
    assert [g.step for g in gens] == [8, 10]
    assert {g.run_id for g in gens} == {first.run_id} and second.run_id == first.run_id


def test_ckpt_path_last_resumes_from_the_newest_committed_generation(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path, [ours], max_steps=4, accumulate=1)
    store = CheckpointStore(str(tmp_path))
    store.begin(6).write_bytes("checkpoint.ckpt", b"uncommitted")  # a newer, uncommitted generation
    again = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)
    trainer, _ = _fit(tmp_path, [again], max_steps=6, accumulate=1, ckpt_path="last")
    # Resumed from step 4 (not the uncommitted 6): two more steps, then step 6 committed over the leftover.
    assert trainer.global_step == 6
    assert [g.step for g in CheckpointStore(str(tmp_path), check_writable=False).generations()] == [2, 4, 6]


def test_every_model_checkpoint_hook_is_overridden():
    # Pins what ckpt_path="last" support relies on: subclassing ModelCheckpoint must not run any of its saving.
    from lightning.pytorch.callbacks import Callback

    hooks = [n for n in vars(Callback) if not n.startswith("_") and callable(getattr(Callback, n))]
    inherited = [
        h
        for h in hooks
        if getattr(AsyncCheckpointCallback, h) is getattr(ModelCheckpoint, h)
        and getattr(ModelCheckpoint, h) is not getattr(Callback, h)
    ]
    assert inherited == []
    # ...and Lightning still resolves "last" through ModelCheckpoint._find_last_checkpoints.
    assert callable(getattr(ModelCheckpoint, "_find_last_checkpoints", None))


class _WritesWeightsInValidation(pl.Callback):
    """Like Lightning's WeightAveraging/SWA: writes the live weights in place between the cut and the next batch."""

    def on_validation_epoch_start(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(1.0)


class _ReadsOnly(pl.Callback):
    lightning_async_ckpt_read_only = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass


def test_a_callback_hook_between_the_cut_and_the_next_batch_puts_everything_at_the_cut(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, save_on_train_end=False, save_top_k=-1)
    _fit(tmp_path, [_WritesWeightsInValidation(), ours], max_steps=4, accumulate=1)
    manifest = CheckpointStore(str(tmp_path), check_writable=False).manifest(2)
    assert {r["fence"] for r in manifest.plan["rows"]} == {"cut"}
    assert any("on_validation_epoch_start" in f for f in manifest.plan["failures"])


def test_a_callback_declared_read_only_keeps_the_deferral(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, save_on_train_end=False, save_top_k=-1)
    _fit(tmp_path, [_ReadsOnly(), ours], max_steps=4, accumulate=1)
    fences = {
        r["category"]: r["fence"] for r in CheckpointStore(str(tmp_path), check_writable=False).manifest(2).plan["rows"]
    }
    assert fences["parameter"] == "optimizer_step"


def test_final_checkpoint_is_taken_even_when_the_last_cuts_were_skipped(tmp_path):
    import threading

    from lightning_async_ckpt.testing import Fault

    release = threading.Event()

    class ReleaseAtLastBatch(pl.Callback):
        lightning_async_ckpt_read_only = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:  # runs before the checkpoint callback's own hook (those are ordered last)
                release.set()

    stall_first = Fault(op="pipe_file", path="step-00000001/manifest.json", stall=release)
    ours = AsyncCheckpointCallback(
        dirpath=f"faulty://{tmp_path}",
        storage_options={"target_protocol": "file", "faults": [stall_first]},
        every_n_train_steps=1,
        admission="skip",
        save_top_k=-1,
    )
    _fit(tmp_path, [ReleaseAtLastBatch(), ours], max_steps=4, accumulate=1)
    # Steps 2-3 arrived while step 1 was still uploading; step 4 is the known last batch: the final cut waits.
    assert ours.skipped == 2
    steps = [g.step for g in CheckpointStore(str(tmp_path), check_writable=False).generations()]
    assert steps == [1, 4] and ours.committed_step == 4


def test_event_log_of_a_run_draws_a_timeline(tmp_path):
    import json

    from lightning_async_ckpt.tools.cli import main

    log = tmp_path / "events.jsonl"
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, event_log=str(log))
    _fit(tmp_path, [ours], max_steps=6, accumulate=1)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"train_step", "request", "staged", "uploaded", "committed", "save"} <= kinds
    assert sorted({e["step"] for e in events if e["event"] == "committed"}) == [2, 4, 6]
    png = tmp_path / "timeline.png"
    assert main(["timeline", str(log), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Wide(BNDropoutModel):
    def __init__(self) -> None:
        super().__init__(width=512)
        self.net.insert(3, torch.nn.Linear(512, 512))  # 1 MB of parameters, 3 MB with Adam's moments


def test_staging_pool_is_filled_before_the_first_cut_so_the_cut_allocates_almost_nothing(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=4, save_on_train_end=False)
    _fit(tmp_path, [ours], max_steps=4, accumulate=1, model=_Wide())
    pool = ours.checkpointer.pool
    assert ours.committed_step == 4
    # Parameters, buffers and optimizer state were reserved after the first optimizer step; the first cut only
    # allocated the small rest (RNG states, scheduler and loop state).
    assert pool.peak_bytes > 3_000_000  # (the pool is emptied when the fit ends)
    assert pool.bytes_allocated_at_cut < 0.01 * pool.peak_bytes


def test_full_checksum_guard_is_selectable_from_the_callback(tmp_path):
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2, guard="full", save_on_train_end=False)
    assert ours.options.guard == "full"
    _fit(tmp_path, [ours], max_steps=4)
    assert ours.committed_step == 4
    with pytest.raises(ConfigError, match="guard"):
        AsyncCheckpointCallback(dirpath=str(tmp_path), guard="everything")


def test_the_final_checkpoint_is_copied_at_the_cut_so_a_write_after_it_can_neither_reach_it_nor_refuse_it(tmp_path):
    # A callback that says it only reads, but writes the weights in place at the epoch end: after the final cut
    # (the known last batch), before any fence. The final save's upload is held until that write happened. The final
    # checkpoint is copied at the cut, so it holds the weights of step 3's batch end (what ModelCheckpoint writes
    # there), is committed at once and never refused; it used to be refused and retaken in on_train_end, after the
    # write and the epoch's end (issue 21).
    import threading

    from lightning_async_ckpt.testing import Fault

    written = threading.Event()

    class LiesAboutReadingOnly(pl.Callback):
        lightning_async_ckpt_read_only = True

        def on_train_epoch_end(self, trainer, pl_module):
            with torch.no_grad():
                pl_module.net[0].weight.mul_(0.5)
            written.set()

    hold = Fault(op="open", path="step-00000003/checkpoint.ckpt", stall=written, times=1)
    ours = AsyncCheckpointCallback(
        dirpath=f"faulty://{tmp_path}",
        storage_options={"target_protocol": "file", "faults": [hold]},
        every_n_train_steps=100,
    )
    _, model = _fit(tmp_path, [LiesAboutReadingOnly(), ours], max_steps=3, accumulate=1, limit_train_batches=3)
    outcomes = [(r.requested_step, r.outcome) for r in ours.checkpointer.records]
    assert outcomes == [(3, "committed")]
    assert ours.committed_step == 3
    store = CheckpointStore(str(tmp_path), check_writable=False)
    saved = torch.load(store.open(3, "checkpoint.ckpt"), map_location="cpu", weights_only=False)
    assert torch.equal(saved["state_dict"]["net.0.weight"] * 0.5, model.net[0].weight.detach())
    assert saved["epoch"] == 0
    assert all("ends training" in r["rule"] or r["fence"] == "cut" for r in store.manifest(3).plan["rows"])


def test_latest_checkpoint_of_a_parent_folder_is_an_error_naming_the_subfolder(tmp_path):
    # The folder above dirpath (say, the experiment folder): None would start training from scratch.
    store = CheckpointStore(str(tmp_path / "exp" / "ckpt"))
    with AsyncCheckpointer(store) as ckpt:
        ckpt.save(2, {"w": torch.ones(2)}).result(timeout=60)
    with pytest.warns(UserWarning, match=r"subfolders hold some: ckpt"):
        assert latest_checkpoint(str(tmp_path / "exp")) is None
    assert latest_checkpoint(str(tmp_path / "missing")) is None  # listed and empty: a first run


def test_last_with_a_callback_folder_nested_in_another_callbacks_resumes(tmp_path):
    # ckpts (epoch ends, nothing committed yet) and ckpts/best (every 2 steps): "last" resumes from ckpts/best.
    def callbacks():
        return [
            AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpts"), save_on_train_end=False, save_top_k=-1),
            AsyncCheckpointCallback(dirpath=str(tmp_path / "ckpts" / "best"), every_n_train_steps=2, save_top_k=-1),
        ]

    _fit(tmp_path, callbacks(), max_steps=4, accumulate=1)
    trainer, _ = _fit(tmp_path, callbacks(), max_steps=6, accumulate=1, ckpt_path="last")
    assert trainer.global_step == 6
    assert [g.step for g in CheckpointStore(str(tmp_path / "ckpts" / "best")).generations()] == [2, 4, 6]


def test_committed_step_after_a_resume_with_nothing_left_to_train_is_the_resumed_step(tmp_path):
    # The README's script run a second time: it resumes at max_steps and trains nothing; committed_step is the
    # newest recoverable checkpoint (the one resumed), not None.
    _fit(tmp_path, [AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)], max_steps=4, accumulate=1)
    again = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)
    _fit(tmp_path, [again], max_steps=4, accumulate=1, ckpt_path=latest_checkpoint(str(tmp_path)))
    assert again.committed_step == 4
