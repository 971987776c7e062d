"""Which checkpoint is "latest" never depends on a writer's clock (``committed_at``).

A job resumed on a node whose clock is an hour behind writes manifests that look an hour old. Generations rank by
step within a folder and by version across ``dirpath`` and its version folders: ``latest()``, retention,
``latest_checkpoint`` and ``ckpt_path="last"`` agree on the newest step.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

HOUR = 3600.0


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", f"step {step}".encode())
    writer.commit()


def _clock_behind(folder: Path, steps: list[int], seconds: float = HOUR) -> None:
    """Rewrite the manifests of ``steps`` as a writer whose clock is ``seconds`` behind would have written them."""
    for step in steps:
        path = folder / f"step-{step:08d}" / "manifest.json"
        body = json.loads(path.read_bytes())
        body["committed_at"] -= seconds
        path.write_text(json.dumps(body))


def test_a_version_resumed_on_a_node_an_hour_behind_is_still_the_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = CheckpointStore(str(root), run_id="first")
    for step in (2, 4):
        _commit(first, step)
    branch = CheckpointStore(str(root / "v1"), run_id="second")
    for step in (2, 4, 6, 8):
        _commit(branch, step)
    _clock_behind(root / "v1", [6, 8])  # the resumed job's commits, on the slow node
    assert latest_checkpoint(str(root)) == str(root / "v1" / "step-00000008" / "checkpoint.ckpt")


def test_latest_retention_and_latest_checkpoint_agree_on_the_newest_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root), run_id="run")
    for step in (2, 4, 6, 8):
        _commit(store, step)
    _clock_behind(root, [6, 8])
    assert store.latest().step == 8
    assert latest_checkpoint(str(root)).endswith("step-00000008/checkpoint.ckpt")
    assert CheckpointStore(str(root), run_id="run").retain(2).removed == [2, 4]


def _fit(callback: AsyncCheckpointCallback, *, max_steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer


def test_ckpt_path_last_resumes_the_newest_step_whatever_the_writers_clocks(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    _fit(
        AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=4
    )  # dirpath: steps 2, 4
    _fit(AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1), max_steps=4)  # a fresh re-run: v1
    # The re-run resumed on a node an hour behind: v1's steps 6 and 8 look older than dirpath's step 4.
    _fit(
        AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1),
        max_steps=8,
        ckpt_path=latest_checkpoint(root),
    )
    _clock_behind(tmp_path / "ckpt" / "v1", [6, 8])
    seen: list[int] = []

    class Counting(BNDropoutModel):
        def training_step(self, batch, batch_idx):
            seen.append(self.trainer.global_step)
            return super().training_step(batch, batch_idx)

    pl.seed_everything(7)
    trainer = pl.Trainer(
        max_steps=10,
        callbacks=[AsyncCheckpointCallback(dirpath=root, every_n_train_steps=2, save_top_k=-1)],
        **trainer_kwargs(),
    )
    trainer.fit(Counting(), make_loader(), ckpt_path="last")
    assert seen[0] == 8  # resumed from v1's step 8, not dirpath's step 4
    assert not (tmp_path / "ckpt" / "v2").exists()  # continued v1 in place: no branch
    assert [g.step for g in CheckpointStore(f"{root}/v1", check_writable=False).generations()] == [2, 4, 6, 8, 10]
