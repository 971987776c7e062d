"""Two tiers for Accelerate (issue 25): ``attach(accelerator, uri, local_dirpath=...)`` commits every cut locally and
promotes the due ones to ``uri``; ``load_state(..., local_dirpath=...)`` resumes from the newest verified generation
of either tier; a real signal turns the next ``save_state`` into the emergency save."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.errors import ConfigError  # noqa: E402
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402


def _steps(uri: str, options: dict | None = None) -> list[int]:
    return [g.step for g in CheckpointStore(uri, options, check_writable=False).generations()]


def _weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.acc.unwrap_model(run.model).state_dict().items()}


def _train_and_save(local: str, durable: str, steps: int, options: dict | None = None, **kwargs) -> object:
    run = make_run()
    ckpt = attach(
        run.acc,
        durable,
        storage_options=options,
        local_dirpath=local,
        local_every_n_train_steps=2,
        every_n_train_steps=4,
        **kwargs,
    )
    for _ in range(steps):
        train(run, 1)
        save_state(run.acc)  # after every step: a cut when due on either cadence
    ckpt.close()
    return run


def _same_objects(local: CheckpointStore, durable: CheckpointStore, step: int) -> None:
    theirs = [(o.name, o.size, o.checksum) for o in durable.manifest(step).objects]
    assert [(o.name, o.size, o.checksum) for o in local.manifest(step).objects] == theirs
    assert durable.verify(step).ok
    assert durable.manifest(step).extra[PROMOTED_FROM_KEY]["step"] == step


def test_cuts_go_local_the_due_ones_are_promoted_equal_with_retention_per_tier(tmp_path: Path) -> None:
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    _train_and_save(local, durable, 12, local_keep_last=2, keep_last=2)
    assert _steps(local) == [10, 12]
    assert _steps(durable) == [8, 12]
    _same_objects(CheckpointStore(local, check_writable=False), CheckpointStore(durable, check_writable=False), 12)
    # accelerate's own loader still reads a local generation folder
    run = make_run(seed=1)
    run.acc.load_state(str(tmp_path / "local" / "step-00000012"))


def test_resume_prefers_the_local_tier_and_continues_training_identically(tmp_path: Path) -> None:
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    straight = _train_and_save(local + "-straight", durable + "-straight", 16)
    expected = _weights(straight)
    _train_and_save(local, durable, 10)  # local: 2..10, durable: 4, 8
    run = make_run(seed=7)
    ckpt = attach(run.acc, durable, local_dirpath=local, local_every_n_train_steps=2, every_n_train_steps=4)
    manifest = load_state(run.acc, durable, local_dirpath=local)
    assert manifest is not None and manifest.step == 10 and PROMOTED_FROM_KEY not in manifest.extra
    for _ in range(6):
        train(run, 1)
        save_state(run.acc)
    ckpt.close()
    for name, tensor in expected.items():
        torch.testing.assert_close(_weights(run)[name], tensor, rtol=0, atol=0, msg=name)
    assert _steps(local) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert _steps(durable) == [4, 8, 12, 16]


@pytest.mark.parametrize("how", ["deleted", "damaged", "behind"])
def test_a_missing_damaged_or_older_local_tier_resumes_from_uri(tmp_path: Path, how: str) -> None:
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    _train_and_save(local, durable, 12)  # local: 2..12, durable: 4, 8, 12
    if how == "deleted":
        shutil.rmtree(local)
    elif how == "damaged":
        with open(tmp_path / "local" / "step-00000012" / "model.safetensors", "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\0\0\0\1")  # same size, other bytes: only the checksum can tell
    else:
        shutil.rmtree(tmp_path / "local" / "step-00000012")  # the newest local one (10) is older than uri's 12
    run = make_run(seed=7)
    if how == "damaged":
        with pytest.warns(UserWarning, match="skipping local generation"):
            manifest = load_state(run.acc, durable, local_dirpath=local)
    else:
        manifest = load_state(run.acc, durable, local_dirpath=local)
    assert manifest is not None and manifest.step == 12
    assert manifest.extra[PROMOTED_FROM_KEY]["step"] == 12  # read from uri, the durable tier


def test_emergency_save_under_a_real_signal_is_committed_locally_and_promoted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    before = signal.getsignal(signal.SIGUSR1)
    run = make_run()
    ckpt = attach(
        run.acc,
        durable,
        local_dirpath=local,
        local_every_n_train_steps=2,
        every_n_train_steps=8,
        preemption_signal=signal.SIGUSR1,
        preemption_grace_s=60,
    )
    stopped = None
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        for step in range(1, 21):
            train(run, 1)
            if step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler's signal, delivered to this process
            save_state(run.acc)
            if ckpt.preempted:
                stopped = step
                break
    assert stopped == 5
    assert ckpt.promoted_step == 5  # promoted within the grace period, before save_state returned
    ckpt.close()
    assert _steps(local) == [2, 4, 5]
    assert _steps(durable) == [5]
    assert CheckpointStore(durable, check_writable=False).verify(5).ok
    assert any("emergency checkpoint at step 5: committed step 5" in r.getMessage() for r in caplog.records)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_s3_as_the_durable_tier(tmp_path: Path, s3_uri: tuple[str, dict]) -> None:
    durable, options = s3_uri
    local = str(tmp_path / "local")
    _train_and_save(local, durable, 8, options)
    assert _steps(durable, options) == [4, 8]
    _same_objects(CheckpointStore(local, check_writable=False), CheckpointStore(durable, options), 8)
    shutil.rmtree(local)  # a new node: the local tier is gone
    run = make_run(seed=7)
    manifest = load_state(run.acc, durable, storage_options=options, local_dirpath=local)
    assert manifest is not None and manifest.step == 8 and PROMOTED_FROM_KEY in manifest.extra


def test_tier_arguments_are_checked(tmp_path: Path) -> None:
    run = make_run()
    with pytest.raises(ConfigError, match="need local_dirpath"):
        attach(run.acc, str(tmp_path / "d"), every_n_train_steps=4)
    with pytest.raises(ConfigError, match="local_dirpath needs uri"):
        attach(run.acc, local_dirpath=str(tmp_path / "l"))
    with pytest.raises(ConfigError, match="local_keep_last must be None or an int >= 1"):
        attach(run.acc, str(tmp_path / "d"), local_dirpath=str(tmp_path / "l"), local_keep_last=0)
    with pytest.raises(ConfigError, match="preemption_signal"):
        attach(run.acc, str(tmp_path / "d"), local_dirpath=str(tmp_path / "l"), preemption_signal=signal.SIGKILL)


def test_an_emergency_save_right_after_a_local_cut_of_the_same_step_promotes_that_cut(tmp_path: Path) -> None:
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    run = make_run()
    ckpt = attach(run.acc, durable, local_dirpath=local, every_n_train_steps=8)
    train(run, 4)
    save_state(run.acc)  # step 4: local only (not due on uri)
    ckpt.emergency_save()  # the same step: no second cut (a committed name is never written twice); promoted
    assert ckpt.preempted and "promoted step 4" in (ckpt.last_emergency or "")
    ckpt.close()
    assert _steps(local) == [4]
    assert _steps(durable) == [4]
