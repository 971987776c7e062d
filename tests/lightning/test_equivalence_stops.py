"""The end of training and refused cuts near it: every committed step equals ``ModelCheckpoint``'s file of that step.

A stop decided after the cut (``EarlyStopping`` in validation or at the epoch's end, ``should_stop`` set in
``training_step``), a cut refused right before an exception, and a refused durable cut with two tiers. The
refusals are made deterministic with :class:`~tests.helpers.hold_staging.HoldStaging`: the staging copy waits
until the write under test ran.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests.helpers.hold_staging import HoldStaging
from tests.helpers.models import (
    BNDropoutModel,
    assert_same,
    load_checkpoint,
    make_loader,
    trainer_kwargs,
    without_model_checkpoint_state,
)


class _Counted(pl.LightningModule):
    """A call counter written in ``forward`` through ``.data`` (no version bump), validation's forward included."""

    def __init__(self, raise_in_validation: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros(4))
        self.hold: HoldStaging | None = None
        self.raise_in_validation = raise_in_validation

    def forward(self, x):
        self.calls.data += 1.0
        if self.hold is not None:
            self.hold.release()
        return self.lin(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.raise_in_validation:
            raise RuntimeError("validation failed")
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int, seed: int) -> DataLoader:
    """``make_loader``'s data, in order (not shuffled)."""
    return DataLoader(make_loader(n=n, seed=seed).dataset, batch_size=8)


def _steps(path) -> list[int]:
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


def _assert_equal_to_sync(async_dir, sync_dir, steps) -> None:
    store = CheckpointStore(str(async_dir), check_writable=False)
    for step in steps:
        theirs = without_model_checkpoint_state(load_checkpoint(str(sync_dir / f"step={step}.ckpt")))
        mine = without_model_checkpoint_state(load_checkpoint(store.object_url(step, "checkpoint.ckpt")))
        assert_same(theirs, mine, f"step{step}")


def test_a_cut_followed_by_validation_that_early_stopping_ends_is_committed_as_model_checkpoints_step(tmp_path):
    # The cut at step 4 is the epoch's last batch; validation after it writes the counter, and EarlyStopping stops
    # training in that validation. The cut used to be deferred (refused by the guard) and retaken in on_train_end,
    # after the epoch ended, as step 4: another epoch, another counter, another loop state.
    for run in range(2):
        root = tmp_path / str(run)
        ours = AsyncCheckpointCallback(dirpath=str(root / "async"), every_n_train_steps=4)
        sync = ModelCheckpoint(dirpath=root / "sync", every_n_train_steps=4, save_top_k=-1, filename="{step}")
        stop = EarlyStopping(monitor="val_loss", stopping_threshold=1e9, check_on_train_epoch_end=False)
        hold = HoldStaging(ours, at={4})
        model = _Counted()
        model.hold = hold
        pl.seed_everything(3)
        trainer = pl.Trainer(max_epochs=3, callbacks=[hold, stop, sync, ours], **trainer_kwargs())
        trainer.fit(model, _loader(32, 0), _loader(16, 5))
        assert trainer.global_step == 4 and trainer.should_stop
        assert _steps(root / "async") == [4]
        _assert_equal_to_sync(root / "async", root / "sync", [4])
        assert [r.outcome for r in ours.checkpointer.records] == ["committed"]


class _StopsInTrainingStep(BNDropoutModel):
    def __init__(self, stop_at: int | None) -> None:
        super().__init__()
        self.stop_at = stop_at

    def training_step(self, batch, batch_idx):
        if self.stop_at is not None and self.global_step + 1 == self.stop_at:
            self.trainer.should_stop = True  # a target reached: known at this batch's end
        return super().training_step(batch, batch_idx)


def _fit_stopping(callbacks, *, stop_at, ckpt_path=None, **trainer_args):
    pl.seed_everything(5)
    model = _StopsInTrainingStep(stop_at)
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(**trainer_args))
    trainer.fit(model, DataLoader(make_loader(n=96).dataset, batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def test_a_stop_set_in_training_step_is_checkpointed_at_that_batch_end_and_resumes_like_model_checkpoints(tmp_path):
    # should_stop set in training_step at step 5 (mid-epoch, 12 batches per epoch): the batch end knows the end.
    # The final checkpoint used to be taken in on_train_end, after the epoch was counted done: a resume from it
    # skipped the rest of the epoch.
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=3, save_top_k=-1)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer, _ = _fit_stopping([sync, ours], stop_at=5, max_steps=20)
    assert trainer.global_step == 5
    assert _steps(tmp_path / "async") == [3, 5]
    _assert_equal_to_sync(tmp_path / "async", tmp_path / "sync", [3, 5])
    mine = CheckpointStore(str(tmp_path / "async"), check_writable=False).object_url(5, "checkpoint.ckpt")
    _, from_ours = _fit_stopping([], stop_at=None, max_steps=9, ckpt_path=mine, enable_checkpointing=False)
    _, from_sync = _fit_stopping(
        [], stop_at=None, max_steps=9, ckpt_path=str(tmp_path / "sync" / "step=5.ckpt"), enable_checkpointing=False
    )
    assert_same(from_sync.state_dict(), from_ours.state_dict(), "resumed")


class _LogsTrainLoss(BNDropoutModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


def test_a_stop_decided_at_the_epoch_end_is_checkpointed_there_like_model_checkpoints_epoch_end_file(tmp_path):
    # EarlyStopping on a training metric stops in on_train_epoch_end (step 12, not on the every-5-steps schedule).
    # The final checkpoint is taken right there (ModelCheckpoint's epoch-end save), not after the fit loop counted
    # the epoch done (on_train_end), which used to be committed as step 12 with another epoch and loop state.
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=5, save_top_k=-1)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_epochs=1, save_top_k=-1, filename="{step}")
    stop = EarlyStopping(monitor="train_loss", stopping_threshold=1e9, check_on_train_epoch_end=True)
    pl.seed_everything(5)
    trainer = pl.Trainer(max_epochs=4, callbacks=[stop, sync, ours], **trainer_kwargs())
    trainer.fit(_LogsTrainLoss(), make_loader(n=96))
    assert trainer.global_step == 12
    assert _steps(tmp_path / "async") == [5, 10, 12]
    _assert_equal_to_sync(tmp_path / "async", tmp_path / "sync", [12])


def test_a_cut_refused_right_before_an_exception_is_written_as_the_exception_checkpoint(tmp_path, caplog):
    # The cut at step 4 is refused (validation writes the counter before its copy), then validation raises.
    # ModelCheckpoint has step=4.ckpt (its step counts as saved from the cut on); the refused cut used to leave
    # nothing at all. The exception checkpoint is written instead, and the log says why.
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=4, save_on_exception=True)
    sync = ModelCheckpoint(
        dirpath=tmp_path / "sync", every_n_train_steps=4, save_top_k=-1, filename="{step}", save_on_exception=True
    )
    hold = HoldStaging(ours, at={4})
    model = _Counted(raise_in_validation=True)
    model.hold = hold
    pl.seed_everything(3)
    trainer = pl.Trainer(max_epochs=3, callbacks=[hold, sync, ours], **trainer_kwargs())
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"), pytest.raises(RuntimeError, match="valid"):
        trainer.fit(model, _loader(32, 0), _loader(16, 5))
    assert (tmp_path / "sync" / "step=4.ckpt").exists()
    assert _steps(tmp_path / "async") == []
    assert [r.outcome for r in ours.checkpointer.records] == ["torn"]
    written = tmp_path / "async" / "epoch=0-step=4.ckpt"
    assert written.exists(), sorted(p.name for p in (tmp_path / "async").iterdir())
    exception_state = load_checkpoint(str(written))
    assert exception_state["global_step"] == 4
    # What it is: the state at the exception, after validation's forward wrote the counter.
    assert torch.equal(exception_state["state_dict"]["calls"], model.calls)
    assert any("refused" in r.getMessage() and str(written) in r.getMessage() for r in caplog.records)


class _WritesAfterTheCutAt(pl.LightningModule):
    """Writes its weight through ``.data`` in the step after the cut at ``step``, before that cut's staging copy
    (parameters are fenced at the optimizer step; no buffers, so nothing releases the copy earlier)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.step = step
        self.hold: HoldStaging | None = None

    def training_step(self, batch, batch_idx):
        if self.global_step == self.step:
            self.lin.weight.data[0].mul_(0.5)
            self.hold.release()
        x, y = batch
        return nn.functional.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_refused_durable_cut_is_retaken_durable_too(tmp_path):
    # dirpath every 4 steps, the local tier every 2: the cut at 4 is refused; its retake at step 5 used to be
    # committed locally only, leaving dirpath with nothing between the start and step 8.
    ours = AsyncCheckpointCallback(
        dirpath=str(tmp_path / "durable"),
        every_n_train_steps=4,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=2,
        save_top_k=-1,
    )
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    hold = HoldStaging(ours, at={4})
    model = _WritesAfterTheCutAt(4)
    model.hold = hold
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=10, callbacks=[hold, sync, ours], **trainer_kwargs(enable_checkpointing=True))
    trainer.fit(model, DataLoader(make_loader().dataset, batch_size=8))
    assert "torn" in [r.outcome for r in ours.checkpointer.records]
    assert 4 not in _steps(tmp_path / "local")
    assert _steps(tmp_path / "durable") == [5, 8, 10]
    _assert_equal_to_sync(tmp_path / "durable", tmp_path / "sync", [5, 8, 10])
