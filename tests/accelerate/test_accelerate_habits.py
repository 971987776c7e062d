"""Issue 39: habits Accelerate users bring (round 4) — attach after prepare, accelerate's own load after a kill.

A real ``Accelerator`` on CPU and real local folders.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

from lightning_async_ckpt.accelerate import attach  # noqa: E402
from lightning_async_ckpt.errors import ConfigError  # noqa: E402


# -- point 4: attach() before prepare() ---------------------------------------------------------------------
def test_attach_before_prepare_is_refused_naming_the_order(tmp_path):
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"after accelerator\.prepare"):
        attach(acc, str(tmp_path / "ckpt"))
    model, opt = acc.prepare(model, opt)
    ckpt = attach(acc, str(tmp_path / "ckpt"))  # in the documented order it is accepted
    ckpt.close()


# -- point 3: accelerate's own load_state after a kill -----------------------------------------------------------
def _automatic(project_dir):
    from accelerate.utils import ProjectConfiguration, set_seed

    from tests.helpers.accelerate_runs import reset_accelerate

    reset_accelerate()
    set_seed(0)
    acc = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True)
    )
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt):
    acc.backward(model(torch.randn(4, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _killed_run(tmp_path):
    """checkpoint_0..2 committed, then checkpoint_3 as a kill leaves it: marked incomplete, no manifest."""
    import shutil

    from lightning_async_ckpt.accelerate import INCOMPLETE_MARKER

    acc, model, opt = _automatic(str(tmp_path))
    ckpt = attach(acc)
    for _ in range(3):
        _step(acc, model, opt)
        acc.save_state()
    ckpt.close()
    crashed = tmp_path / "checkpoints" / "checkpoint_3"
    shutil.copytree(tmp_path / "checkpoints" / "checkpoint_2", crashed)
    (crashed / "manifest.json").unlink()
    (crashed / INCOMPLETE_MARKER).write_text("{}")


def test_accelerates_own_load_state_on_an_uncommitted_save_names_the_librarys_load_state(tmp_path):
    from lightning_async_ckpt.errors import CheckpointError

    _killed_run(tmp_path)
    acc, model, opt = _automatic(str(tmp_path))  # the restarted job, unchanged
    ckpt = attach(acc)
    with pytest.raises(CheckpointError) as info:
        acc.load_state()
    message = str(info.value)
    assert "from lightning_async_ckpt.accelerate import load_state" in message
    assert f"load_state(accelerator, {str(tmp_path / 'checkpoints')!r})" in message
    assert "checkpoint_2" in message  # the newest committed one, what that call loads
    ckpt.close()


def test_the_next_save_after_accelerates_own_load_of_a_committed_folder_continues_the_numbering(tmp_path):
    from lightning_async_ckpt.accelerate.folders import accelerate_folders

    _killed_run(tmp_path)
    acc, model, opt = _automatic(str(tmp_path))  # iteration back at 0
    ckpt = attach(acc)
    acc.load_state(str(tmp_path / "checkpoints" / "checkpoint_2"))
    _step(acc, model, opt)
    acc.save_state()  # checkpoint_4: past every folder that exists, the uncommitted one included
    ckpt.close()
    states = {f.name: f.state for f in accelerate_folders(str(tmp_path / "checkpoints")) or []}
    assert states["checkpoint_4"] == "committed" and states["checkpoint_3"] == "uncommitted"


# -- point 3: two processes, save_state() then sys.exit() ---------------------------------------------------------
@pytest.mark.slow
def test_two_processes_save_state_then_exit_commit_the_last_save(tmp_path):
    import json
    import sys

    from lightning_async_ckpt.accelerate.folders import accelerate_folders
    from tests.helpers.dist import launch_ranks

    for proc in launch_ranks([sys.executable, __file__, str(tmp_path)], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
    states = {f.name: f.state for f in accelerate_folders(str(tmp_path / "checkpoints")) or []}
    assert states == {"checkpoint_0": "committed", "checkpoint_1": "committed"}, states
    assert json.loads((tmp_path / "checkpoints" / "checkpoint_1" / "manifest.json").read_text())["step"] == 2


def _exit_worker(project_dir: str) -> None:
    """One rank: the usual end of an Accelerate script, a save and then sys.exit() without close()."""
    import sys

    acc, model, opt = _automatic(project_dir)
    attach(acc)
    for _ in range(2):
        _step(acc, model, opt)
        acc.save_state()  # checkpoint_0 (step 1), checkpoint_1 (step 2)
    sys.exit(0)


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    _exit_worker(sys.argv[1])
