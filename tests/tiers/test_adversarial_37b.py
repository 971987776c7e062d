"""Second review probes of issue 37 (tiers beneath the one engine), as a demanding user would try them: the Lightning
callback's ``ckpt_path="last"`` and ``latest_checkpoint(dirpath, local_dirpath=)`` with the durable dirpath spelled
another way at resume, local version folders from earlier restarts, a fresh run over the same folders, the emergency
save of a resumed run, and Accelerate's ``load_state(..., local_dirpath=)`` in the same situations."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.tiers.promote import DURABLE_TIER_KEY, PROMOTED_FROM_KEY
from tests.helpers.damage import flip_tail
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

_STEP = re.compile(r"step-(\d{8})")


def _gen(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _steps(path: Path | str) -> list[int]:
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


def _damage(generation: Path) -> None:
    biggest = max((p for p in generation.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    flip_tail(biggest)


def _where(path: str | None, local: Path) -> tuple[str, int] | None:
    """("local" | "durable", step) of a resume answer; the local answer keeps its version folder (``local/v1``)."""
    if path is None:
        return None
    step = int(_STEP.findall(path)[-1])
    real, local_s = os.path.realpath(path.removeprefix("file://")), os.path.realpath(local)
    if real.startswith(local_s + "/"):
        rest = real[len(local_s) :].lstrip("/")
        version = rest.split("/")[0] if rest.startswith("v") else ""
        return (f"local/{version}" if version else "local", step)
    return ("durable", step)


class _Started(Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


class _SignalAt(Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum, self.sent = step, signum, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def _fit(
    durable: str,
    local: str,
    max_steps: int,
    ckpt_path: str | None = None,
    extra: list | None = None,
    **kw,
) -> tuple[pl.Trainer, _Started]:
    pl.seed_everything(7)
    args = dict(
        dirpath=durable,
        every_n_train_steps=4,
        local_dirpath=local,
        local_every_n_train_steps=2,
        save_top_k=-1,
        save_on_train_end=False,
    )
    args.update(kw)
    started = _Started()
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=[AsyncCheckpointCallback(**args), started, *(extra or [])], **trainer_kwargs()
    )
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    return trainer, started


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "skipping local generation ...", Lightning's own
        yield


# -- (d) the durable dirpath spelled another way at resume ------------------------------------------------------------


def _spelled(tmp_path: Path, spelling: str, monkeypatch) -> str:
    durable = tmp_path / "durable"
    if spelling == "trailing_slash":
        return f"{durable}/"
    if spelling == "relative":
        monkeypatch.chdir(tmp_path)
        return "durable"
    if spelling == "file_url":
        return f"file://{durable}"
    if spelling == "dot_dot":
        return f"{tmp_path}/local/../durable"
    if spelling == "double_slash":
        return f"{tmp_path}//durable"
    assert spelling == "symlinked_parent"
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-link")
    return f"{tmp_path.parent / f'{tmp_path.name}-link'}/durable"


SPELLINGS = ["trailing_slash", "relative", "file_url", "dot_dot", "double_slash", "symlinked_parent"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_same_run_resumes_its_local_generation_with_dirpath_spelled_another_way(tmp_path, spelling, monkeypatch):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(str(durable), str(local), 6)  # local 2, 4, 6; durable 4
    assert _steps(local) == [2, 4, 6] and _steps(durable) == [4]
    assert CheckpointStore(str(local), check_writable=False).manifest(6).extra[DURABLE_TIER_KEY] == str(durable)
    spelled = _spelled(tmp_path, spelling, monkeypatch)
    with _quiet():
        answer = _where(latest_checkpoint(spelled, local_dirpath=str(local)), local)
        trainer, started = _fit(spelled, str(local), 8, ckpt_path="last")
    assert answer == ("local", 6)
    assert _where(str(trainer.ckpt_path), local) == ("local", 6) and started.step == 6


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_with_nothing_durable_yet_a_spelled_dirpath_never_restarts_from_scratch(tmp_path, spelling, monkeypatch):
    # The job was preempted before its first promotion: the local tier alone holds its progress. A false negative of
    # the lineage filter here is not "a slower durable resume" but training from step 0.
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(str(durable), str(local), 3, every_n_train_steps=100)  # local 2; durable nothing
    assert _steps(local) == [2] and _steps(durable) == []
    spelled = _spelled(tmp_path, spelling, monkeypatch)
    with _quiet():
        answer = _where(latest_checkpoint(spelled, local_dirpath=str(local)), local)
        _, started = _fit(spelled, str(local), 4, ckpt_path="last", every_n_train_steps=100)
    assert answer == ("local", 2) and started.step == 2


def test_written_with_a_file_url_resumed_with_a_plain_path(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(f"file://{durable}/", f"file://{local}", 6)
    with _quiet():
        answer = _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local)
        trainer, started = _fit(str(durable), str(local), 8, ckpt_path="last")
    assert answer == ("local", 6) and started.step == 6


# -- (e) version folders of the local tier from an earlier restart ----------------------------------------------------


def test_a_run_restarted_below_a_damaged_local_generation_resumes_its_local_version_folder_next_time(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(str(durable), str(local), 6)  # local 2, 4, 6; durable 4
    _damage(_gen(local, 6))
    with _quiet():
        _, started = _fit(str(durable), str(local), 10, ckpt_path="last")
    assert started.step == 4
    assert _steps(local / "v1") == [6, 8, 10] and _steps(durable) == [4, 8]
    assert all(str(durable) == CheckpointStore(str(local / "v1")).manifest(s).extra[DURABLE_TIER_KEY] for s in (6, 10))
    with _quiet():
        answer = _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local)
        trainer, started = _fit(str(durable), str(local), 12, ckpt_path="last")
    assert answer == ("local/v1", 10) and started.step == 10
    assert _steps(local / "v1") == [6, 8, 10, 12] and not (local / "v2").exists()  # continued in v1
    # v1's 12 and 10 damaged: durable 12 (intact); without it, 8 (v1's or durable's), never v0's older ones.
    _damage(_gen(local / "v1", 12))
    _damage(_gen(local / "v1", 10))
    with _quiet():
        assert _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local) == ("durable", 12)
    shutil.rmtree(_gen(durable, 12))
    with _quiet():
        answer = _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local)
        _, started = _fit(str(durable), str(local), 9, ckpt_path="last")
    assert answer in {("local/v1", 8), ("durable", 8)} and started.step == 8


def test_a_crash_mid_promotion_beside_a_local_version_folder(tmp_path):
    # (a) and (e) together: the newest local generation lives in v1 and the durable tier holds a newer folder without
    # a manifest (a promotion killed on the old node).
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(str(durable), str(local), 6)
    _damage(_gen(local, 6))
    with _quiet():
        _fit(str(durable), str(local), 10, ckpt_path="last")  # local v1: 6, 8, 10; durable 4, 8
    shutil.copytree(_gen(local / "v1", 10), _gen(durable, 12))
    (_gen(durable, 12) / "manifest.json").unlink()
    with _quiet():
        answer = _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local)
        _, started = _fit(str(durable), str(local), 11, ckpt_path="last")
    assert answer == ("local/v1", 10) and started.step == 10


# -- (c) a fresh run over the same dirpath and local_dirpath ----------------------------------------------------------


def test_a_fresh_run_over_the_same_folders_is_the_one_last_resumes(tmp_path):
    # Run 1 trains to 10. Run 2 starts fresh (no ckpt_path) with the same dirpath and local_dirpath: it writes to
    # dirpath/v1 (and a new local version folder), and stops at 6. ckpt_path="last" without local_dirpath resumes the
    # newest version's newest step (run 2's 4 in dirpath/v1); with local_dirpath it must resume run 2 too, never
    # run 1's step 10.
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(str(durable), str(local), 10)  # run 1: local 2..10; durable 4, 8
    with _quiet():
        _fit(str(durable), str(local), 6)  # run 2, fresh
    assert _steps(durable / "v1") == [4]
    run2 = CheckpointStore(str(durable / "v1"), check_writable=False).manifest(4).run_id
    assert run2 != CheckpointStore(str(durable), check_writable=False).manifest(8).run_id
    with _quiet():
        single = _where(latest_checkpoint(str(durable)), local)
        answer = _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local)
        trainer, started = _fit(str(durable), str(local), 8, ckpt_path="last")
    # run 2's progress, locally (v1's 6) or durable (v1's 4)
    assert (single, answer, started.step) in {
        (("durable", 4), ("local/v1", 6), 6),
        (("durable", 4), ("durable", 4), 4),
    }, (single, answer, started.step, trainer.ckpt_path)


# -- 3. the emergency save of a resumed run with a local tier ---------------------------------------------------------


def test_the_emergency_save_of_a_run_resumed_into_a_local_version_folder_is_committed_and_promoted(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _fit(str(durable), str(local), 6)
    _damage(_gen(local, 6))
    with _quiet():
        trainer, started = _fit(
            str(durable),
            str(local),
            20,
            ckpt_path="last",
            extra=[_SignalAt(7, signal.SIGUSR1)],
            preemption_signal=signal.SIGUSR1,
            preemption_grace_s=60,
        )
    assert started.step == 4 and trainer.global_step == 7
    # Before fit returned: step 7 committed in this run's local version folder and promoted to dirpath.
    assert _steps(local / "v1") == [6, 7] and _steps(durable) == [4, 7]
    promoted = CheckpointStore(str(durable), check_writable=False).manifest(7)
    assert promoted.extra[PROMOTED_FROM_KEY]["step"] == 7
    assert CheckpointStore(str(durable), check_writable=False).verify(7).ok
    with _quiet():
        answer = _where(latest_checkpoint(str(durable), local_dirpath=str(local)), local)
    assert answer == ("local/v1", 7)


# -- 2. Accelerate: load_state(..., local_dirpath=) in the same situations ---------------------------------------------


@pytest.fixture
def accelerate_run():
    pytest.importorskip("accelerate")
    from tests.helpers.accelerate_runs import reset_accelerate

    yield
    reset_accelerate()


def _accelerate_train(durable: str, local: str, steps: int, *, resume: bool = False) -> int | None:
    """Attach with two tiers (local every 2 steps, durable every 4), optionally load_state first, then ``steps``
    save_state calls after one step each; the step resumed (``None``: fresh)."""
    from lightning_async_ckpt.accelerate import attach, load_state, save_state
    from tests.helpers.accelerate_runs import make_run, train

    run = make_run(seed=7)
    ckpt = attach(run.acc, durable, local_dirpath=local, local_every_n_train_steps=2, every_n_train_steps=4)
    try:
        resumed = None
        if resume:
            manifest = load_state(run.acc, durable, local_dirpath=local)
            resumed = None if manifest is None else manifest.step
        for _ in range(steps):
            train(run, 1)
            save_state(run.acc)
    finally:
        ckpt.close()
    return resumed


def _accelerate_answer(durable: str, local: str) -> tuple[str, int] | None:
    from lightning_async_ckpt.accelerate import attach, load_state
    from tests.helpers.accelerate_runs import make_run

    run = make_run(seed=7)
    ckpt = attach(run.acc, durable, local_dirpath=local, local_every_n_train_steps=2, every_n_train_steps=4)
    try:
        manifest = load_state(run.acc, durable, local_dirpath=local)
    finally:
        ckpt.close()
    if manifest is None:
        return None
    return ("durable" if PROMOTED_FROM_KEY in manifest.extra else "local", manifest.step)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_accelerate_load_state_resumes_its_local_generation_with_the_uri_spelled_another_way(
    tmp_path, spelling, monkeypatch, accelerate_run
):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _accelerate_train(str(durable), str(local), 6)  # local 2, 4, 6; durable 4
    assert _steps(local) == [2, 4, 6] and _steps(durable) == [4]
    spelled = _spelled(tmp_path, spelling, monkeypatch)
    with _quiet():
        assert _accelerate_answer(spelled, str(local)) == ("local", 6)


def test_accelerate_restart_below_a_damaged_local_generation_then_resumes_its_version_folder(tmp_path, accelerate_run):
    local, durable = tmp_path / "local", tmp_path / "durable"
    _accelerate_train(str(durable), str(local), 6)  # local 2, 4, 6; durable 4
    _damage(_gen(local, 6))
    with _quiet():
        assert _accelerate_train(str(durable), str(local), 4, resume=True) == 4  # steps 5..8
    assert _steps(local / "v1") == [6, 8] and _steps(durable) == [4, 8]
    with _quiet():
        assert _accelerate_answer(str(durable), str(local)) == ("local", 8)
        from tests.tiers.test_adversarial_37 import _restore

        assert _restore(local, durable)[:2] == ("local", 8)
    # v1's 8 damaged: durable 8 (intact, newer than every other local one)
    _damage(_gen(local / "v1", 8))
    with _quiet():
        assert _accelerate_answer(str(durable), str(local)) == ("durable", 8)


def test_accelerate_crash_mid_promotion_and_another_runs_newer_local_generation(tmp_path, accelerate_run):
    # (a) + (c): a promotion killed on the old node left durable step 8 without a manifest, and another run (its own
    # durable tier) filled the shared local folder with newer steps.
    local, durable = tmp_path / "local", tmp_path / "durable"
    _accelerate_train(str(durable), str(local), 6)
    shutil.copytree(_gen(local, 6), _gen(durable, 8))
    (_gen(durable, 8) / "manifest.json").unlink()
    with _quiet():
        _accelerate_train(str(tmp_path / "other-durable"), str(local / "v7"), 2)  # another run, nested as v7
    with _quiet():
        answer = _accelerate_answer(str(durable), str(local))
    assert answer == ("local", 6)
