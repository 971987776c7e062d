"""Issue 15, finding 1: ``ckpt_path="best"`` / ``"last"``, ``trainer.checkpoint_callback`` beside a real
``ModelCheckpoint``, best-k across a restart, and the callback's ``state_dict``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from tests.helpers.models import make_loader, trainer_kwargs
from tests.helpers.selection import ValModel, committed, step_of, step_of_file

ARGS = dict(monitor="val_loss", save_top_k=2)


def _trainer(callbacks, **kw) -> pl.Trainer:
    return pl.Trainer(callbacks=callbacks, **trainer_kwargs(**kw))


def _loaders():
    return make_loader(n=64), make_loader(n=32, seed=1)


def test_ckpt_path_best_and_last_resolve_to_committed_generations(tmp_path):
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), **ARGS)
    trainer = _trainer([ours], max_epochs=4)
    model = ValModel()
    train, val = _loaders()
    trainer.fit(model, train, val)
    assert trainer.checkpoint_callback is ours
    best = ours.best_model_path
    assert best and step_of(best) in committed(tmp_path)

    trainer.validate(model, val, ckpt_path="best")
    assert trainer.ckpt_path == best
    # Loading restores the callbacks' states: the loaded copy (cut before its own commit) does not roll back "best".
    assert ours.best_model_path == best

    # "last": the newest committed generation, in a new Trainer (fit resumes and trains one more epoch).
    newest = max(committed(tmp_path))
    again = AsyncCheckpointCallback(dirpath=str(tmp_path), **ARGS)
    trainer2 = _trainer([again], max_epochs=5)
    trainer2.fit(ValModel(), train, val, ckpt_path="last")
    assert step_of(trainer2.ckpt_path) == newest == 32
    assert trainer2.global_step == 40


@pytest.mark.parametrize("ours_first", [True, False])
def test_a_model_checkpoint_listed_beside_keeps_checkpoint_callback_and_best(tmp_path, ours_first):
    pl.seed_everything(3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", monitor="val_loss", save_top_k=1)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), monitor="val_acc", mode="max")
    trainer = _trainer([ours, sync] if ours_first else [sync, ours], max_epochs=3)
    model = ValModel()
    train, val = _loaders()
    trainer.fit(model, train, val)
    assert trainer.checkpoint_callback is sync
    assert sync.best_model_path.endswith(".ckpt") and "sync" in sync.best_model_path
    trainer.validate(model, val, ckpt_path="best")
    assert trainer.ckpt_path == sync.best_model_path
    # Both still saved what they were asked to.
    assert committed(tmp_path / "async")


def test_best_k_continues_across_a_restart_like_model_checkpoint(tmp_path):
    # Run 1: 3 epochs; run 2 resumes from the newest committed generation and trains to 6 epochs. The kept set and
    # the best path match a ModelCheckpoint that ran (and resumed) beside it.
    args = dict(ARGS, filename="{epoch}-{step}-{val_loss:.4f}")
    train, val = _loaders()
    pl.seed_everything(3)
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    _trainer([sync, ours], max_epochs=3).fit(ValModel(), train, val)
    resume = latest_checkpoint(str(tmp_path / "async"))
    assert step_of(resume) in {8, 16, 24}  # the newest committed: the newest top-2 save

    pl.seed_everything(3)
    sync2 = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    ours2 = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    _trainer([sync2, ours2], max_epochs=6).fit(ValModel(), train, val, ckpt_path=resume)
    theirs = {step_of_file(p): float(s) for p, s in sync2.best_k_models.items()}
    assert {step_of(p): float(s) for p, s in ours2.best_k_models.items()} == theirs
    assert step_of(ours2.best_model_path) == step_of_file(sync2.best_model_path)
    kept = committed(tmp_path / "async")
    assert set(theirs) <= set(kept) and set(kept) - set(theirs) <= {max(kept)}


def test_state_dict_carries_model_checkpoint_entries_and_load_restores_them(tmp_path):
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), **ARGS)
    train, val = _loaders()
    _trainer([ours], max_epochs=3).fit(ValModel(), train, val)
    state = ours.state_dict()
    for key in ("best_model_path", "best_model_score", "best_k_models", "kth_best_model_path", "last_model_path"):
        assert key in state
    assert state["best_model_path"] == ours.best_model_path and state["run_id"] == ours.run_id
    # ModelCheckpoint's helpers work on the committed view: to_yaml and format_checkpoint_name.
    ours.to_yaml(str(tmp_path / "best_k.yaml"))
    written = yaml.safe_load((tmp_path / "best_k.yaml").read_text())
    assert written == {p: pytest.approx(float(v)) for p, v in ours.best_k_models.items()}
    assert ours.format_checkpoint_name({"epoch": 1, "step": 5}) == str(tmp_path / "epoch=1-step=5.ckpt")
    fresh = AsyncCheckpointCallback(dirpath=str(tmp_path), **ARGS)
    fresh.load_state_dict(state)
    assert fresh.best_model_path == ours.best_model_path and fresh.best_k_models == ours.best_k_models
    # A checkpoint's own copy is ModelCheckpoint's: as it is once that checkpoint is saved (it is its own best).
    ckpt = torch.load(ours.best_model_path, weights_only=False)
    saved = next(v for k, v in ckpt["callbacks"].items() if k.startswith("AsyncCheckpointCallback"))
    assert saved["best_model_path"] == ours.best_model_path
    assert all(step_of(p) <= ckpt["global_step"] for p in saved["best_k_models"])


def test_best_k_and_ckpt_path_best_on_s3_with_storage_options_only(s3_uri):
    # On an object store: displaced generations are removed, and "best" loads through the callback's options.
    uri, options = s3_uri
    pl.seed_everything(3)
    ours = AsyncCheckpointCallback(dirpath=uri, storage_options=options, monitor="val_loss", save_top_k=1)
    trainer = _trainer([ours], max_epochs=3)
    model = ValModel()
    train, val = _loaders()
    trainer.fit(model, train, val)
    assert ours.best_model_path.startswith("s3://")
    steps = [g.step for g in CheckpointStore(uri, options, check_writable=False).generations()]
    assert steps == sorted({step_of(ours.best_model_path), 24})
    trainer.validate(model, val, ckpt_path="best")
    assert trainer.ckpt_path == ours.best_model_path


def test_resuming_an_older_best_checkpoint_keeps_it_in_the_top_k_like_model_checkpoint(tmp_path):
    # fit(ckpt_path=cb.best_model_path) from an older step: ModelCheckpoint restores its best_k_models, so "best"
    # never points at a worse model than the one resumed from. Here the fit branches into a new version (newer
    # steps exist in dirpath) and must still rank the generations of the run it resumed, without removing them.
    from tests.helpers.selection import fit

    args = dict(monitor="val_loss", mode="min", save_top_k=3, filename="{epoch}-{step}")
    sync = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    fit([sync], max_epochs=4)
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    fit([ours], max_epochs=4)
    assert float(ours.best_model_score) == pytest.approx(float(sync.best_model_score))
    first_best, first_kept = ours.best_model_path, set(committed(tmp_path / "async"))

    sync2 = ModelCheckpoint(dirpath=tmp_path / "sync", **args)
    fit([sync2], max_epochs=6, ckpt_path=sync.best_model_path)
    ours2 = AsyncCheckpointCallback(dirpath=str(tmp_path / "async"), save_on_train_end=False, **args)
    with pytest.warns(UserWarning, match="v1"):
        trainer, _ = fit([ours2], max_epochs=6, ckpt_path=first_best)
    assert float(ours2.best_model_score) == pytest.approx(float(sync2.best_model_score))
    assert step_of(ours2.best_model_path) == step_of_file(sync2.best_model_path)
    assert sorted(step_of(p) for p in ours2.best_k_models) == sorted(step_of_file(p) for p in sync2.best_k_models)
    # The branch's retention never touched the generations of the run it resumed.
    assert set(committed(tmp_path / "async")) == first_kept
    assert trainer.validate(ValModel(), make_loader(n=32, seed=1), ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == ours2.best_model_path


class _ScriptedVal(pl.LightningModule):
    """val_loss follows a script per epoch (0.5, 0.1, 0.4, 0.6, 0.7): the best is epoch 1."""

    VALS = (0.5, 0.1, 0.4, 0.6, 0.7)

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.tensor(self.VALS[min(self.current_epoch, len(self.VALS) - 1)]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _scripted_fit(callback, max_epochs, ckpt_path=None):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    pl.seed_everything(1)
    trainer = pl.Trainer(callbacks=[callback], **trainer_kwargs(max_epochs=max_epochs, limit_val_batches=1))
    trainer.fit(_ScriptedVal(), data, data, ckpt_path=ckpt_path)
    return trainer, data


def test_resuming_a_model_checkpoint_last_file_keeps_its_best_like_model_checkpoint(tmp_path):
    # The script used ModelCheckpoint(monitor=..., save_last=True) and now uses this callback with ckpt_path="last":
    # ModelCheckpoint would keep its restored best (epoch 1, 0.1); "best" must not become the newest, worse one.
    args = dict(monitor="val_loss", save_top_k=1, save_last=True)
    _scripted_fit(ModelCheckpoint(dirpath=tmp_path, **args), max_epochs=3)
    old_best = next(tmp_path.glob("epoch=1-*.ckpt"))
    ours = AsyncCheckpointCallback(dirpath=str(tmp_path), **args)
    trainer, data = _scripted_fit(ours, max_epochs=5, ckpt_path="last")
    assert ours.best_model_path == str(old_best) and float(ours.best_model_score) == pytest.approx(0.1)
    trainer.validate(_ScriptedVal(), data, ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == str(old_best)
    assert old_best.exists()  # a file of the ModelCheckpoint run: ranked, never removed by this callback
