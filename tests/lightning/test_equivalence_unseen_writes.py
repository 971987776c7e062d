"""Writes the deferral proof cannot see, made to land between the cut and the staging copy on purpose.

Every test holds the staging thread (a task queued before the cut's copy, released by ``threading.Event``) until
the write under test ran, or until the training thread reaches a fence (then the write comes after the copy, as
it must when the proof placed the fence right). The outcome is therefore the same on every run: with the exact
default guard every committed checkpoint equals the synchronous ``ModelCheckpoint`` file of its step, whatever the
timing; a write that does not bump a version counter (``.data``) is refused and retaken, never committed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore
from tests.helpers.hold_staging import HoldStaging
from tests.helpers.models import assert_same, load_checkpoint, trainer_kwargs, without_model_checkpoint_state

ROWS, DIM = 65_536, 64  # a 16 MB table: a 256-byte row is missed by 64 sampled bytes with probability 0.999
PAD = ROWS - 1


class PaddedTable(pl.LightningModule):
    """An embedding whose padding row is reset through ``.data`` at the start of each step (no version bump)."""

    def __init__(self, *, clamp_in_pre_hook: bool = False, grad_hook: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 2)
        self.hold: HoldStaging | None = None
        self.clamp_in_pre_hook = clamp_in_pre_hook
        self.grad_hook = grad_hook
        self.reset_pad = not (clamp_in_pre_hook or grad_hook)
        if grad_hook:
            # A gradient hook that decays the table in place through .data: it runs in backward, before the fence.
            self.emb.weight.register_hook(self._decay)

    def _decay(self, grad):
        self.emb.weight.data[PAD].mul_(0.5)
        self._released()
        return grad

    def _released(self) -> None:
        if self.hold is not None:
            self.hold.release()

    def training_step(self, batch, batch_idx):
        if self.reset_pad:
            self.emb.weight.data[PAD].zero_()  # the padding idiom: bypasses the version counter
            self._released()
        idx, y = batch
        return nn.functional.cross_entropy(self.head(self.emb(idx)), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        if self.clamp_in_pre_hook:

            def clamp(optimizer, args, kwargs):
                self.emb.weight.data[PAD].clamp_(-0.01, 0.01)  # runs before the closure, hence before our fence
                self._released()

            opt.register_step_pre_hook(clamp)
        return opt


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.cat([torch.full((4,), PAD), ROWS - 2 - torch.randint(0, 16, (60,), generator=g)])
    return DataLoader(TensorDataset(idx, torch.randint(0, 2, (64,), generator=g)), batch_size=8, shuffle=False)


def _fit_and_compare(
    tmp_path, model: PaddedTable, *, max_steps: int = 6, val_data=None, **fit_kwargs
) -> AsyncCheckpointCallback:
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), every_n_train_steps=1, save_on_train_end=False)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    hold = HoldStaging(ours)
    model.hold = hold
    pl.seed_everything(3)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[hold, sync, ours], **trainer_kwargs(**fit_kwargs))
    trainer.fit(model, _loader(), val_data)
    store = CheckpointStore(str(tmp_path / "async"), check_writable=False)
    steps = [g.step for g in store.generations()]
    assert steps, "nothing committed"
    for step in steps:
        theirs = without_model_checkpoint_state(load_checkpoint(str(tmp_path / "sync" / f"step={step}.ckpt")))
        mine = without_model_checkpoint_state(load_checkpoint(store.object_url(step, "checkpoint.ckpt")))
        assert_same(theirs, mine, f"step{step}")
    assert hold.held >= 3
    return ours


def test_a_data_write_that_bumps_no_version_counter_is_refused_by_the_default_guard_never_committed(tmp_path):
    for run in range(2):
        ours = _fit_and_compare(tmp_path / str(run), PaddedTable())
        outcomes = [r.outcome for r in ours.checkpointer.records]
        assert "torn" in outcomes, outcomes  # the write landed before the copy: refused (then demoted, retaken)


def test_an_optimizer_step_pre_hook_moves_the_fence_to_batch_start(tmp_path):
    ours = _fit_and_compare(tmp_path, PaddedTable(clamp_in_pre_hook=True))
    plan = CheckpointStore(str(tmp_path / "async"), check_writable=False).manifest(4).plan
    params = [r for r in plan["rows"] if r["category"] == "parameter"]
    assert params and all(r["fence"] == "batch_start" for r in params), params
    assert any("step pre-hook" in f for f in plan["failures"]), plan["failures"]
    assert "torn" not in [r.outcome for r in ours.checkpointer.records]


def test_a_global_optimizer_step_pre_hook_moves_the_fence_to_batch_start(tmp_path):
    model = PaddedTable()
    model.reset_pad = False

    def clamp(optimizer, args, kwargs):
        model.emb.weight.data[PAD].clamp_(-0.01, 0.01)
        model._released()

    handle = register_optimizer_step_pre_hook(clamp)
    try:
        ours = _fit_and_compare(tmp_path, model)
    finally:
        handle.remove()
    plan = CheckpointStore(str(tmp_path / "async"), check_writable=False).manifest(4).plan
    assert any("global optimizer step pre-hook" in f for f in plan["failures"]), plan["failures"]
    assert "torn" not in [r.outcome for r in ours.checkpointer.records]


class _Extragradient(torch.optim.SGD):
    """An optimizer subclass whose ``step`` writes the parameters before it calls the closure (extragradient)."""

    def __init__(self, params, model: PaddedTable) -> None:
        super().__init__(params, lr=0.5)
        self.model = model

    @torch.no_grad()
    def step(self, closure=None):
        self.model.emb.weight.data[PAD].mul_(0.9)  # the look-ahead half step, through .data
        self.model._released()
        return super().step(closure)


class _ExtragradientTable(PaddedTable):
    def configure_optimizers(self):
        return _Extragradient(self.parameters(), self)


def test_an_optimizer_overriding_step_is_unknown_and_fenced_at_batch_start(tmp_path):
    model = _ExtragradientTable()
    model.reset_pad = False
    ours = _fit_and_compare(tmp_path, model)
    plan = CheckpointStore(str(tmp_path / "async"), check_writable=False).manifest(4).plan
    assert any("overrides step" in f for f in plan["failures"]), plan["failures"]
    assert "torn" not in [r.outcome for r in ours.checkpointer.records]


def test_a_parameter_gradient_hook_writing_the_weight_moves_the_fence_to_batch_start(tmp_path):
    ours = _fit_and_compare(tmp_path, PaddedTable(grad_hook=True))
    plan = CheckpointStore(str(tmp_path / "async"), check_writable=False).manifest(4).plan
    assert any("gradient hook" in f for f in plan["failures"]), plan["failures"]
    assert "torn" not in [r.outcome for r in ours.checkpointer.records]


class _Observed(pl.LightningModule):
    """Eager-QAT-like: an observer buffer that every forward updates, validation's included (after the cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.register_buffer("observed_max", torch.zeros(8))
        self.hold: HoldStaging | None = None

    def forward(self, x):
        self.observed_max.data.copy_(torch.maximum(self.observed_max, x.abs().amax(0)))  # through .data
        if self.hold is not None:
            self.hold.release()
        return self.lin(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _observed_loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g) * (1 + seed)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def test_the_final_checkpoint_is_copied_at_the_cut_and_equals_model_checkpoint_despite_validation_after_it(tmp_path):
    # The last step is saved at its batch end (every_n_train_steps), then epoch-end validation updates the observer:
    # the final checkpoint must hold the state at the cut (epoch 0, the observer before validation), like
    # ModelCheckpoint's file of that step, never a retake after validation and the epoch's end.
    for run in range(2):
        root = tmp_path / str(run)
        ours = AsyncCheckpointCallback(dirpath=str(root / "async"), every_n_train_steps=4)
        sync = ModelCheckpoint(dirpath=root / "sync", every_n_train_steps=4, save_top_k=-1, filename="{step}")
        hold = HoldStaging(ours, last_too=True)
        model = _Observed()
        model.hold = hold
        pl.seed_everything(3)
        trainer = pl.Trainer(max_epochs=1, callbacks=[hold, sync, ours], **trainer_kwargs())
        trainer.fit(model, _observed_loader(0), _observed_loader(5))
        store = CheckpointStore(str(root / "async"), check_writable=False)
        assert [g.step for g in store.generations()] == [4]
        theirs = without_model_checkpoint_state(load_checkpoint(str(root / "sync" / "step=4.ckpt")))
        mine = without_model_checkpoint_state(load_checkpoint(store.object_url(4, "checkpoint.ckpt")))
        assert_same(theirs, mine, "final")
        assert mine["epoch"] == 0
        assert [r.outcome for r in ours.checkpointer.records] == ["committed"]
        rows = store.manifest(4).plan["rows"]
        assert all(r["fence"] == "cut" for r in rows), rows


class _NumpyStatistic(PaddedTable):
    """A hand-written buffer that validation updates through a numpy view (no version counter at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.reset_pad = False
        self.register_buffer("val_seen", torch.zeros(1 << 20))  # 4 MB

    def validation_step(self, batch, batch_idx):
        idx, y = batch
        view = self.val_seen.numpy()
        view[idx.numpy() % view.shape[0]] += 1.0  # a few words, through numpy
        self._released()
        self.log("val_loss", nn.functional.cross_entropy(self.head(self.emb(idx)), y))


def test_a_buffer_written_through_numpy_in_validation_after_the_cut_is_refused_never_committed(tmp_path):
    ours = _fit_and_compare(tmp_path, _NumpyStatistic(), val_data=_loader(), val_check_interval=2, limit_val_batches=1)
    outcomes = [r.outcome for r in ours.checkpointer.records]
    assert "torn" in outcomes, outcomes
