"""One cross-tier resume (issue 37): every entry point gives the same answer on the same two-tier layout.

Each layout is written by a real integration (a Lightning ``Trainer`` with ``AsyncCheckpointCallback(local_dirpath=)``,
an ``Accelerator`` with ``attach(..., local_dirpath=)``): local steps 2, 4, 6, durable step 4. Then one case is made:

- ``durable_newer_without_manifest``: the durable tier holds a newer folder without a manifest (a promotion killed on
  the old node): never a generation, so the local step 6 wins;
- ``damaged_newest_local``: one byte of the newest local generation changed (same size): step 4, intact on both tiers,
  read locally;
- ``another_runs_newer_local``: another run's newer generation (step 8) in the shared ``local_dirpath``: never this
  run's, so step 6;
- ``local_missing``: the local tier is gone: the durable step 4.

The entry points: ``TieredCheckpointer.restore()``, ``latest_checkpoint(dirpath, local_dirpath=)``,
``ckpt_path="last"`` with ``local_dirpath`` and Accelerate's ``load_state(..., local_dirpath=)``.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

CASES = {
    "durable_newer_without_manifest": ("local", 6),
    "damaged_newest_local": ("local", 4),
    "another_runs_newer_local": ("local", 6),
    "local_missing": ("durable", 4),
}
_STEP = re.compile(r"step-(\d{8})")


def _gen(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _make_case(case: str, local: Path, durable: Path) -> None:
    assert [g.step for g in CheckpointStore(str(local), check_writable=False).generations()] == [2, 4, 6]
    assert [g.step for g in CheckpointStore(str(durable), check_writable=False).generations()] == [4]
    if case == "durable_newer_without_manifest":
        shutil.copytree(_gen(local, 6), _gen(durable, 8))
        (_gen(durable, 8) / "manifest.json").unlink()
    elif case == "damaged_newest_local":
        biggest = max(
            (p for p in _gen(local, 6).iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size
        )
        with open(biggest, "r+b") as f:
            f.seek(-4, 2)
            tail = f.read(4)
            f.seek(-4, 2)
            f.write(bytes(b ^ 0xFF for b in tail))  # same size, other bytes: only the checksum tells
        assert not CheckpointStore(str(local), check_writable=False).verify(6).ok
    elif case == "another_runs_newer_local":
        shutil.copytree(_gen(local, 6), _gen(local, 8))
        path = _gen(local, 8) / "manifest.json"
        body = json.loads(path.read_text())
        body["run_id"], body["step"] = "another-run", 8
        path.write_text(json.dumps(body))
        other = CheckpointStore(str(local), check_writable=False)
        assert other.manifest(8).run_id == "another-run" and other.verify(8).ok  # an intact generation of its own
    else:
        shutil.rmtree(local)


def _answer(path: str | None, local: Path) -> tuple[str, int] | None:
    if path is None:
        return None
    return ("local" if str(local) in path else "durable", int(_STEP.findall(path)[-1]))


def _restore(local: Path, durable: Path) -> tuple[str, int] | None:
    ckpt = TieredCheckpointer(str(local), str(durable), every_n_train_steps=4)
    try:
        restored = ckpt.restore()
    finally:
        ckpt.close()
    return None if restored is None else (restored.tier, restored.step)


def _callback(tmp_path: Path) -> AsyncCheckpointCallback:
    return AsyncCheckpointCallback(
        dirpath=str(tmp_path / "durable"),
        every_n_train_steps=4,
        local_dirpath=str(tmp_path / "local"),
        local_every_n_train_steps=2,
        save_top_k=-1,
        save_on_train_end=False,
    )


def _fit(tmp_path: Path, max_steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(7)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[_callback(tmp_path)], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("case", sorted(CASES))
def test_restore_latest_checkpoint_and_ckpt_path_last_agree_on_a_lightning_layout(tmp_path: Path, case: str) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(tmp_path, 6)
    _make_case(case, local, durable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "skipping local generation ...": the damaged case says so
        answers = {
            "latest_checkpoint": _answer(latest_checkpoint(str(durable), local_dirpath=str(local)), local),
            "TieredCheckpointer.restore": _restore(local, durable),
            'ckpt_path="last"': _answer(_fit(tmp_path, 8, ckpt_path="last").ckpt_path, local),
        }
    assert answers == dict.fromkeys(answers, CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_restore_and_accelerate_load_state_agree_on_an_accelerate_layout(tmp_path: Path, case: str) -> None:
    pytest.importorskip("accelerate")
    from lightning_async_ckpt.accelerate import attach, load_state, save_state
    from tests.helpers.accelerate_runs import make_run, train

    local, durable = tmp_path / "local", tmp_path / "durable"
    tiers = {"local_dirpath": str(local), "local_every_n_train_steps": 2, "every_n_train_steps": 4}
    run = make_run()
    ckpt = attach(run.acc, str(durable), **tiers)
    for _ in range(6):
        train(run, 1)
        save_state(run.acc)
    ckpt.close()
    _make_case(case, local, durable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        restored = _restore(local, durable)
        run = make_run(seed=7)
        ckpt = attach(run.acc, str(durable), **tiers)
        try:
            manifest = load_state(run.acc, str(durable), local_dirpath=str(local))
        finally:
            ckpt.close()
    assert manifest is not None
    loaded = ("durable" if PROMOTED_FROM_KEY in manifest.extra else "local", manifest.step)
    assert {"TieredCheckpointer.restore": restored, "load_state": loaded} == {
        "TieredCheckpointer.restore": CASES[case],
        "load_state": CASES[case],
    }
