"""``ls`` and ``verify`` read accelerate's checkpoint folders: ``<project_dir>/checkpoints`` of ``checkpoint_N``
folders, or one ``save_state`` folder (issue 15, item 6), with every state a crash can leave."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import INCOMPLETE_MARKER  # noqa: E402
from lightning_async_ckpt.accelerate.folders import accelerate_folders  # noqa: E402
from lightning_async_ckpt.tools.cli import main  # noqa: E402
from tests.helpers.accelerate_runs import commit_folder, make_run, train  # noqa: E402


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    """checkpoint_0 intact (step 2), checkpoint_1 damaged (step 3), checkpoint_2 a crashed save, checkpoint_3 a
    plain accelerate save (no manifest)."""
    root = tmp_path / "project" / "checkpoints"
    commit_folder(root / "checkpoint_0", steps=2)
    commit_folder(root / "checkpoint_1", steps=3)
    weights = root / "checkpoint_1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # same size, other bytes: only a checksum tells
    weights.write_bytes(bytes(data))
    shutil.copytree(root / "checkpoint_0", root / "checkpoint_2")
    (root / "checkpoint_2" / "manifest.json").unlink()
    (root / "checkpoint_2" / INCOMPLETE_MARKER).write_text("{}")
    (root / "checkpoint_2" / "model.safetensors").write_bytes(b"\x00" * 10)
    plain = make_run()
    train(plain, 1)
    plain.acc.save_state(str(root / "checkpoint_3"))
    return root


def test_ls_lists_every_checkpoint_n_folder_with_its_state(checkpoints: Path, capsys) -> None:
    rc, out, _ = _run(capsys, "ls", str(checkpoints))
    assert rc == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("checkpoint_")}
    assert set(lines) == {"checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"}
    assert lines["checkpoint_0"].split()[1:3] == ["2", "committed"]
    assert lines["checkpoint_1"].split()[1:3] == ["3", "committed"]  # ls reads manifests; verify reads bytes
    assert lines["checkpoint_2"].split()[1:3] == ["-", "uncommitted"]
    assert lines["checkpoint_3"].split()[1:3] == ["-", "foreign"]
    assert "2 committed" in out and "2 not committed" in out

    rc, out, _ = _run(capsys, "ls", str(checkpoints), "--json")
    rows = json.loads(out)
    assert [(r["folder"], r["state"], r["step"]) for r in rows] == [
        ("checkpoint_0", "committed", 2),
        ("checkpoint_1", "committed", 3),
        ("checkpoint_2", "uncommitted", None),
        ("checkpoint_3", "foreign", None),
    ]
    assert rows[0]["bytes"] > 0 and rows[0]["objects"] >= 5


def test_verify_names_the_damaged_folder_and_exits_1(checkpoints: Path, capsys) -> None:
    rc, out, err = _run(capsys, "verify", str(checkpoints))
    assert rc == 1
    assert "checkpoint_0 (step 2): OK" in out
    assert "checkpoint_1 (step 3): FAILED" in out and "model.safetensors" in out and "checksum" in out
    assert "skipped checkpoint_2: uncommitted" in out and "skipped checkpoint_3: foreign" in out
    assert "checkpoint_1" in err

    rc, out, _ = _run(capsys, "verify", str(checkpoints), "--step", "2", "--json")
    body = json.loads(out)
    assert rc == 0 and body["ok"] and [r["folder"] for r in body["results"]] == ["checkpoint_0"]


def test_verify_of_an_unknown_step_is_a_usage_error(checkpoints: Path, capsys) -> None:
    rc, _, err = _run(capsys, "verify", str(checkpoints), "--step", "7")
    assert rc == 2 and "step(s) [7]" in err and "2, 3" in err


def test_one_save_state_folder_is_listed_and_verified(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "ckpt"
    commit_folder(folder, steps=2)
    rc, out, _ = _run(capsys, "ls", str(folder))
    assert rc == 0 and out.splitlines()[1].split()[:3] == ["ckpt", "2", "committed"]
    rc, out, _ = _run(capsys, "verify", str(folder))
    assert rc == 0 and "ckpt (step 2): OK" in out
    (folder / "optimizer.bin").unlink()
    rc, out, _ = _run(capsys, "verify", str(folder))
    assert rc == 1 and "optimizer.bin: missing" in out


def test_a_folder_with_only_uncommitted_saves_has_nothing_to_verify(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    folder.mkdir(parents=True)
    (folder / INCOMPLETE_MARKER).write_text("{}")
    rc, _, err = _run(capsys, "verify", str(tmp_path / "checkpoints"))
    assert rc == 2 and "no committed checkpoint folder" in err and "checkpoint_0 (uncommitted)" in err


def test_a_store_root_is_not_read_as_an_accelerate_layout(tmp_path: Path) -> None:
    (tmp_path / "step-00000001").mkdir()
    assert accelerate_folders(str(tmp_path)) is None
    assert accelerate_folders(str(tmp_path / "missing")) is None


def test_gc_refuses_accelerate_folders_and_deletes_nothing(checkpoints: Path, capsys) -> None:
    before = sorted(p.name for p in checkpoints.iterdir())
    rc, _, err = _run(capsys, "gc", str(checkpoints), "--keep-last", "1")
    assert rc == 2 and "total_limit" in err
    assert sorted(p.name for p in checkpoints.iterdir()) == before


def test_ls_of_the_project_dir_names_the_checkpoints_subfolder(checkpoints: Path, capsys) -> None:
    # <project_dir> given instead of <project_dir>/checkpoints: a usage error naming it, never "no generations", 0.
    rc, _, err = _run(capsys, "ls", str(checkpoints.parent))
    assert rc == 2 and "checkpoints" in err
