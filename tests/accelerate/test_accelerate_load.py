"""``lightning_async_ckpt.accelerate.load_state``: no code execution by default, loud RNG skips, crash leftovers.

Real ``Accelerator`` on CPU; the generations are written by the hook path (``attach`` + ``accelerator.save_state``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import INCOMPLETE_MARKER, attach, load_state  # noqa: E402
from lightning_async_ckpt.errors import CheckpointError  # noqa: E402
from lightning_async_ckpt.storage.io import Checksum  # noqa: E402
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402

LOG = "lightning_async_ckpt"


def _committed_folder(folder: Path, steps: int = 2) -> None:
    """A hook-path folder committed at ``steps`` (model, optimizer, scheduler, RNG and one custom object)."""
    run = make_run()
    ckpt = attach(run.acc)
    train(run, steps)
    run.acc.save_state(str(folder))
    ckpt.close()
    assert (folder / "manifest.json").exists()


def _replace_object(folder: Path, name: str, data: bytes | None) -> None:
    """What someone who can write the store can do: swap (or drop) a file and re-sign the manifest to match."""
    manifest = Manifest.from_json((folder / "manifest.json").read_bytes())
    entry = manifest.object(name)
    objects = [o for o in manifest.objects if o.name != name]
    if data is None:
        (folder / name).unlink()
    else:
        (folder / name).write_bytes(data)
        digest = Checksum(entry.checksum.split(":", 1)[0])
        digest.update(data)
        objects.append(ObjectEntry(name=name, size=len(data), checksum=digest.hexdigest()))
    (folder / "manifest.json").write_bytes(dataclasses.replace(manifest, objects=tuple(objects)).to_json())


def _plant(marker: str) -> dict[str, int]:
    """Runs when a planted pickle is unpickled without restriction: leaves a file behind as proof."""
    Path(marker).touch()
    return {"n": 7}


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_plant, (self.marker,))


def _planted_pickle(marker: Path) -> bytes:
    path = marker.with_suffix(".pkl")
    torch.save(_Planted(marker), path)
    return path.read_bytes()


# -- loading is never code execution by default ---------------------------------------------------------------
def test_a_planted_custom_object_pickle_is_refused_without_the_trust_flag(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _committed_folder(folder)
    marker = tmp_path / "code-ran"
    _replace_object(folder, "custom_checkpoint_0.pkl", _planted_pickle(marker))

    resumed = make_run(seed=3)
    with pytest.raises(CheckpointError, match="trust_pickled_objects=True") as info:
        load_state(resumed.acc, str(folder))
    assert "custom_checkpoint_0.pkl" in str(info.value) and "weights_only" in str(info.value)
    assert not marker.exists()  # refused before anything unpickled it
    assert resumed.counter.n == 0

    # The caller who trusts the writers can opt in: accelerate then unpickles it (and the planted code runs).
    load_state(resumed.acc, str(folder), trust_pickled_objects=True)
    assert marker.exists() and resumed.counter.n == 7


def test_plain_data_custom_objects_load_without_the_flag_from_a_copy_we_control(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _committed_folder(folder, steps=3)
    resumed = make_run(seed=4)
    assert load_state(resumed.acc, str(folder)).step == 3
    assert resumed.counter.n == 3  # restored through the weights_only=True reading


def test_a_missing_rng_file_is_a_warning_not_silence(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "ckpt"
    _committed_folder(folder)
    _replace_object(folder, "random_states_0.pkl", None)
    resumed = make_run(seed=5)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert load_state(resumed.acc, str(folder)).step == 2
    assert any("random_states_0.pkl" in r.getMessage() and "not restored" in r.getMessage() for r in caplog.records)


def test_an_unreadable_rng_file_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "ckpt"
    _committed_folder(folder)
    _replace_object(folder, "random_states_0.pkl", _planted_pickle(tmp_path / "rng-code-ran"))
    resumed = make_run(seed=6)
    with caplog.at_level(logging.WARNING, logger=LOG):
        load_state(resumed.acc, str(folder))
    assert not (tmp_path / "rng-code-ran").exists()  # accelerate reads RNG states with weights_only=True
    assert any("cannot be loaded" in r.getMessage() and "not restored" in r.getMessage() for r in caplog.records)


# -- after a crash --------------------------------------------------------------------------------------------
def test_the_newest_incomplete_checkpoint_n_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoints = tmp_path / "project" / "checkpoints"
    _committed_folder(checkpoints / "checkpoint_0", steps=2)
    # checkpoint_1: a save that a crash interrupted (marker, no manifest, a truncated weights file).
    shutil.copytree(checkpoints / "checkpoint_0", checkpoints / "checkpoint_1")
    (checkpoints / "checkpoint_1" / "manifest.json").unlink()
    (checkpoints / "checkpoint_1" / INCOMPLETE_MARKER).write_text("{}")
    (checkpoints / "checkpoint_1" / "model.safetensors").write_bytes(b"\x00" * 10)
    resumed = make_run(seed=8)
    with caplog.at_level(logging.WARNING, logger=LOG):
        manifest = load_state(resumed.acc, str(checkpoints))
    assert manifest is not None and manifest.step == 2
    warned = [r.getMessage() for r in caplog.records if "checkpoint_1" in r.getMessage()]
    assert warned and "not committed" in warned[0] and "checkpoint_0" in warned[0]


def test_a_half_written_folder_raises_a_clear_checkpoint_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _committed_folder(folder)
    (folder / "manifest.json").unlink()
    (folder / INCOMPLETE_MARKER).write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\x00" * 10)  # what accelerate alone would fail on
    with pytest.raises(CheckpointError, match="uncommitted asynchronous save"):
        load_state(make_run(seed=9).acc, str(folder))


def test_a_folder_of_accelerate_files_without_a_manifest_is_an_error(tmp_path: Path) -> None:
    run = make_run()
    train(run, 1)
    run.acc.save_state(str(tmp_path / "sync"))  # plain accelerate: no manifest proves it complete
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_state(make_run(seed=2).acc, str(tmp_path / "sync"))


def test_nothing_to_load_returns_none_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert load_state(make_run().acc, str(tmp_path / "empty-store")) is None
    assert any("nothing was loaded" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("layout", ["checkpoint_N", "store"])
def test_a_uri_one_level_above_the_checkpoints_is_an_error_naming_the_subfolder(tmp_path: Path, layout: str) -> None:
    # The project_dir given to ProjectConfiguration instead of <project_dir>/checkpoints (or a store's parent): a
    # silent None would restart training from scratch.
    project = tmp_path / "project"
    if layout == "checkpoint_N":
        _committed_folder(project / "checkpoints" / "checkpoint_0")
    else:
        from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore

        with AsyncCheckpointer(CheckpointStore(str(project / "checkpoints"))) as ckpt:
            ckpt.save(3, {"w": torch.ones(2)}).result(timeout=60)
    with pytest.raises(CheckpointError, match=r"checkpoints"):
        load_state(make_run(seed=3).acc, str(project))
