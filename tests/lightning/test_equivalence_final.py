"""Class D of issue 12: the final checkpoint is the one a synchronous ModelCheckpoint writes at the last batch end.

Lightning runs end-of-epoch bookkeeping and every other callback's ``on_train_end`` after the last batch (e.g.
``EMAWeightAveraging`` copies the averaged weights into the model there); a final checkpoint taken after them
would resume one epoch ahead or from the averaged weights. It is taken at the last batch end instead.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests.helpers.models import (
    BNDropoutModel,
    assert_same,
    load_checkpoint,
    make_loader,
    trainer_kwargs,
    without_model_checkpoint_state,
)


def _fit(callbacks, *, ckpt_path=None, seed=5, **trainer_args):
    pl.seed_everything(seed)
    model = BNDropoutModel()
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(**trainer_args))
    trainer.fit(model, make_loader(n=96), ckpt_path=ckpt_path)  # 12 batches per epoch
    return trainer, model


def _compare_final(tmp_path, step: int, extra_callbacks=(), **trainer_args) -> CheckpointStore:
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=5)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit([*(cb() for cb in extra_callbacks), sync, ours], **trainer_args)
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    assert store.generations()[-1].step == step
    theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={step}.ckpt")))
    mine = without_model_checkpoint_state(load_checkpoint(store.object_url(step, "checkpoint.ckpt")))
    assert_same(theirs, mine, f"final step {step}")
    return store


def test_final_checkpoint_at_max_steps_mid_epoch_with_ema_resumes_like_model_checkpoint(tmp_path):
    # max_steps=7 is not a multiple of every_n_train_steps=5 and falls mid-epoch; EMA rewrites the live weights at
    # on_train_end. Repeated with three seeds.
    for seed in (5, 6, 7):
        root = tmp_path / str(seed)
        ours = AsyncCheckpointCallback(dirpath=str(root / "async"), every_n_train_steps=5)
        sync = ModelCheckpoint(dirpath=root / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
        _fit([EMAWeightAveraging(decay=0.5), sync, ours], max_steps=7, seed=seed)
        store = CheckpointStore(str(root / "async"), check_writable=False)
        assert [g.step for g in store.generations()] == [5, 7]
        sync_path = str(root / "sync" / "step=7.ckpt")
        theirs = without_model_checkpoint_state(load_checkpoint(sync_path))
        mine = without_model_checkpoint_state(load_checkpoint(store.object_url(7, "checkpoint.ckpt")))
        assert_same(theirs, mine, f"seed{seed}.final")
        # Resuming from either continues identically (mid-epoch, with the EMA state).
        _, from_ours = _fit(
            [EMAWeightAveraging(decay=0.5)],
            max_steps=11,
            ckpt_path=store.object_url(7, "checkpoint.ckpt"),
            enable_checkpointing=False,
            seed=seed,
        )
        _, from_sync = _fit(
            [EMAWeightAveraging(decay=0.5)], max_steps=11, ckpt_path=sync_path, enable_checkpointing=False, seed=seed
        )
        assert_same(from_sync.state_dict(), from_ours.state_dict(), f"seed{seed}.resumed")


def test_final_checkpoint_at_the_last_batch_of_the_last_epoch(tmp_path):
    # max_epochs=2 x 12 batches: the end (step 24) is known at its batch end; not a multiple of 5.
    _compare_final(tmp_path, 24, max_epochs=2)


def test_final_checkpoint_with_accumulation_and_max_steps(tmp_path):
    _compare_final(tmp_path, 7, max_steps=7, accumulate_grad_batches=2)


class _StopsAtStep5(pl.Callback):
    lightning_async_ckpt_read_only = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            trainer.should_stop = True  # before the checkpoint callback's hook (Lightning orders it last)


def test_a_stop_set_by_an_earlier_callback_at_the_batch_end_is_checkpointed_there(tmp_path):
    # Known at this callback's batch end: the final checkpoint is ModelCheckpoint's file of step 5 at that batch end
    # (it used to be taken in on_train_end, after the epoch was counted done).
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer, _ = _fit([_StopsAtStep5(), sync, ours], max_steps=20)
    assert trainer.global_step == 5
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    assert [g.step for g in store.generations()] == [3, 5]
    theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / "step=5.ckpt")))
    assert_same(theirs, without_model_checkpoint_state(load_checkpoint(store.object_url(5, "checkpoint.ckpt"))))


class _Validated(BNDropoutModel):
    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__()
        self.stop_at = stop_at

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.stop_at:
            self.trainer.should_stop = True  # e.g. a target reached: Lightning validates once more before stopping
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))


@pytest.mark.parametrize(
    ("schedule", "final"),
    [
        ({"max_epochs": 2}, 24),
        ({"max_epochs": 2, "val_check_interval": 0.5}, 24),
        # Validation has not run before the last batch here (num_val_batches is still unknown there).
        ({"max_epochs": 2, "check_val_every_n_epoch": 2}, 24),
        # max_steps lands on a mid-epoch validation point: ModelCheckpoint saves after that validation.
        ({"max_steps": 18, "val_check_interval": 0.5}, 18),
        # should_stop set in the last batch: Lightning runs validation after it, whatever the interval.
        ({"max_steps": 15, "val_check_interval": 0.5, "stop_at": 15}, 15),
    ],
    ids=["epoch-end", "half-epoch", "val-every-2-epochs", "max-steps-at-validation", "should-stop-at-the-end"],
)
def test_without_monitor_the_final_step_saved_at_the_epoch_end_is_model_checkpoints_epoch_end_file(
    tmp_path, schedule, final
):
    # Defaults (every_n_epochs=1) save at every epoch end, after validation: ModelCheckpoint writes the last step's
    # file there. The final checkpoint used to be cut at the last batch end instead (same step and name, but before
    # validation and the epoch-end bookkeeping: a resume from it skipped the next on_train_epoch_start).
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", save_top_k=-1, filename="{step}")
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_last=True)
    pl.seed_everything(5)
    schedule = dict(schedule)
    model = _Validated(stop_at=schedule.pop("stop_at", None))
    trainer = pl.Trainer(callbacks=[sync, ours], **schedule, **trainer_kwargs())
    trainer.fit(model, make_loader(n=96), make_loader(n=32, seed=1))
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    assert store.generations()[-1].step == final
    theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={final}.ckpt")))
    mine = without_model_checkpoint_state(load_checkpoint(store.object_url(final, "checkpoint.ckpt")))
    assert_same(theirs, mine, f"final step {final}")
