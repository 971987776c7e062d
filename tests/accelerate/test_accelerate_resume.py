"""Accelerate's automatic checkpoint naming across a crash (issue 23 item 1): after ``load_state`` picks
``checkpoint_N`` the iteration continues past every folder, so numbering never goes backwards and ``total_limit``
never deletes a folder still being written; a folder ``ls`` calls committed always verifies.

Run as a script (``python tests/accelerate/test_accelerate_resume.py OUT PHASE``) it is one rank of the two-process test.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import INCOMPLETE_MARKER, attach, load_state  # noqa: E402
from lightning_async_ckpt.accelerate.folders import accelerate_folders, verify_accelerate_folder  # noqa: E402
from tests.helpers.accelerate_runs import reset_accelerate  # noqa: E402, F401
from tests.helpers.dist import launch_ranks  # noqa: E402

TOTAL_LIMIT = 3


def _automatic(project_dir: str, **config: Any) -> tuple[Any, Any, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    reset_accelerate()
    set_seed(0)
    project = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, **config)
    acc = Accelerator(cpu=True, project_config=project)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc: Any, model: Any, opt: Any) -> None:
    import torch

    acc.backward(model(torch.randn(4, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _states(checkpoints: Path) -> dict[str, str]:
    return {f.name: f.state for f in accelerate_folders(str(checkpoints)) or []}


def test_after_a_crash_the_iteration_continues_past_every_folder_committed_or_not(tmp_path: Path) -> None:
    acc, model, opt = _automatic(str(tmp_path), total_limit=TOTAL_LIMIT)
    ckpt = attach(acc)
    for _ in range(3):
        _step(acc, model, opt)
        acc.save_state()  # checkpoint_0..2
    ckpt.close()
    crashed = tmp_path / "checkpoints" / "checkpoint_3"  # a save the crash interrupted: marked, no manifest
    shutil.copytree(tmp_path / "checkpoints" / "checkpoint_2", crashed)
    (crashed / "manifest.json").unlink()
    (crashed / INCOMPLETE_MARKER).write_text("{}")

    acc, model, opt = _automatic(str(tmp_path), total_limit=TOTAL_LIMIT)  # restarted: iteration 0
    ckpt = attach(acc)
    manifest = load_state(acc, str(tmp_path / "checkpoints"))
    assert manifest is not None and manifest.extra["output_dir"].endswith("checkpoint_2")
    assert acc.project_configuration.iteration == 4  # past checkpoint_3, which is not loadable but exists
    for _ in range(2):
        _step(acc, model, opt)
        acc.save_state()  # checkpoint_4, checkpoint_5: accelerate's total_limit removes 0..2 and 3, never these
    ckpt.close()
    assert _states(tmp_path / "checkpoints") == {
        "checkpoint_3": "uncommitted",
        "checkpoint_4": "committed",
        "checkpoint_5": "committed",
    }


def test_a_folder_with_an_object_gone_is_never_listed_as_committed(tmp_path: Path) -> None:
    acc, model, opt = _automatic(str(tmp_path))
    ckpt = attach(acc)
    _step(acc, model, opt)
    acc.save_state()
    ckpt.close()
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    (folder / "optimizer.bin").unlink()  # e.g. a deletion (accelerate's total_limit) that stopped halfway
    (listed,) = accelerate_folders(str(tmp_path / "checkpoints")) or []
    assert listed.state == "invalid" and not listed.committed and "optimizer.bin: missing" in (listed.error or "")
    assert verify_accelerate_folder(listed)  # verify reports it too


def test_the_hook_path_steps_aside_when_total_limit_could_delete_a_folder_in_flight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from lightning_async_ckpt.accelerate import save_state

    acc, model, opt = _automatic(str(tmp_path), total_limit=1)
    ckpt = attach(acc)  # accepted: the library's own save_state(accelerator) honours total_limit=1 safely
    _step(acc, model, opt)
    save_state(acc).result()  # checkpoint_0, committed
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        acc.save_state()  # accelerate deletes checkpoint_0 first (total_limit=1), then saves checkpoint_1 itself
    assert any("total_limit=1" in r.getMessage() and "synchronously" in r.getMessage() for r in caplog.records)
    ckpt.close()
    assert _states(tmp_path / "checkpoints") == {"checkpoint_1": "foreign"}  # accelerate's own, complete folder
    assert (tmp_path / "checkpoints" / "checkpoint_1" / "model.safetensors").exists()


# -- two processes ---------------------------------------------------------------------------------------------
def _phase(out: Path, phase: str) -> list[dict[str, Any]]:
    results = []
    for proc in launch_ranks([sys.executable, __file__, str(out), phase], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{"))))
    return results


@pytest.mark.slow
def test_two_processes_crash_restart_and_train_past_total_limit(tmp_path: Path) -> None:
    crashed = _phase(tmp_path, "crash")
    assert all(r["iteration"] == 4 for r in crashed)
    checkpoints = tmp_path / "checkpoints"
    assert _states(checkpoints)["checkpoint_3"] == "uncommitted"  # the crash left the last save unconfirmed
    resumed = _phase(tmp_path, "resume")
    for r in resumed:
        assert r["loaded"] == "checkpoint_2" and r["iteration_after_load"] == 4, r
        assert r["error"] is None, r
    states = _states(checkpoints)
    # 5 saves after the restart (checkpoint_4..8), total_limit=3: the newest three remain, all committed and intact.
    assert states == {f"checkpoint_{i}": "committed" for i in (6, 7, 8)}, states
    for folder in accelerate_folders(str(checkpoints)) or []:
        assert verify_accelerate_folder(folder) == [], folder.name


@pytest.mark.slow
def test_two_processes_save_state_without_uri_number_folders_alike_and_keep_total_limit(tmp_path: Path) -> None:
    results = _phase(tmp_path, "automatic")
    assert [r["iteration"] for r in results] == [4, 4]  # the same on both processes, as accelerate's own
    assert all(r["error"] is None for r in results), results
    states = _states(tmp_path / "checkpoints")
    assert states == {f"checkpoint_{i}": "committed" for i in (1, 2, 3)}, states


def _worker(out: str, phase: str) -> None:
    acc, model, opt = _automatic(out, total_limit=TOTAL_LIMIT)
    ckpt = attach(acc)
    report: dict[str, Any] = {"rank": acc.process_index, "error": None}
    if phase == "automatic":
        from lightning_async_ckpt.accelerate import save_state

        try:
            for _ in range(4):
                _step(acc, model, opt)
                save_state(acc)  # the library's own save, accelerate's checkpoint_N naming
            ckpt.close()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["iteration"] = acc.project_configuration.iteration
        print(json.dumps(report), flush=True)
        return
    if phase == "crash":
        for _ in range(3):
            _step(acc, model, opt)
            acc.save_state()
        _step(acc, model, opt)  # confirms checkpoint_2 on every process
        for handle in ckpt.handles:
            handle.result()  # committed (the writer) or mirrored (the other process)
        acc.save_state()  # checkpoint_3: the process dies before anything confirms it
        report["iteration"] = acc.project_configuration.iteration
        print(json.dumps(report), flush=True)
        os._exit(0)
    manifest = load_state(acc, f"{out}/checkpoints")
    report["loaded"] = os.path.basename(manifest.extra["output_dir"]) if manifest else None
    report["iteration_after_load"] = acc.project_configuration.iteration
    try:
        for _ in range(5):
            _step(acc, model, opt)
            acc.save_state()
        ckpt.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
