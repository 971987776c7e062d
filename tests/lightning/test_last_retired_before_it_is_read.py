"""``fit(ckpt_path="last")`` when another writer's retention removes the checkpoint "last" chose before Lightning
reads it: the newest checkpoint then is loaded, never a fresh start nor an error.

The fit (on a thread) is held right before Lightning opens the chosen file; meanwhile a newer generation lands and
the chosen ones are retired as ``keep_last=1`` does (manifest first, then the folder).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback
from tests.helpers.gate import Gate, run_gated
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs


def _fit(dirpath: Path, max_steps: int) -> None:
    pl.seed_everything(7)
    callback = AsyncCheckpointCallback(dirpath=str(dirpath), every_n_train_steps=2, keep_last=2)
    pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs()).fit(BNDropoutModel(), make_loader())


def test_last_loads_the_newest_when_its_choice_is_retired_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    _fit(root, 4)  # steps 2 and 4
    _fit(tmp_path / "elsewhere", 6)  # a real step-6 generation, moved in below as another writer's commit
    seen: list[int] = []

    class Counting(BNDropoutModel):
        def training_step(self, batch, batch_idx):
            seen.append(self.trainer.global_step)
            return super().training_step(batch, batch_idx)

    def commit_6_and_retire_the_rest() -> None:
        shutil.copytree(tmp_path / "elsewhere" / "step-00000006", root / "step-00000006")
        for step in (2, 4):
            (root / f"step-{step:08d}" / "manifest.json").unlink()  # manifest first, as retention removes
            shutil.rmtree(root / f"step-{step:08d}")

    def resume() -> None:
        pl.seed_everything(7)
        callback = AsyncCheckpointCallback(dirpath=str(root), every_n_train_steps=2)
        trainer = pl.Trainer(max_steps=8, callbacks=[callback], **trainer_kwargs())
        trainer.fit(Counting(), make_loader(), ckpt_path="last")

    gate = Gate(monkeypatch, fsspec.filesystem("file"), "_open", lambda path: "step-00000004/" in path)
    run_gated(gate, resume, commit_6_and_retire_the_rest)
    assert seen[0] == 6  # resumed from the newest checkpoint when it read, not from scratch (before: an error)
