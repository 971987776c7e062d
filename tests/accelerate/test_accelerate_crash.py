"""Accelerate after a crash: loading picks the newest intact folder, "nothing" only when nothing is committed, and a
``save_state`` made on the main process only raises instead of hanging.

Run as a script (``python tests/accelerate/test_accelerate_crash.py OUT MODE``) it is one rank of the two-process test.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.errors import CheckpointError  # noqa: E402
from tests.helpers.accelerate_runs import commit_folder, make_run, train  # noqa: E402
from tests.helpers.dist import launch_ranks  # noqa: E402

LOG = "lightning_async_ckpt"


def _flip_a_byte(path: Path) -> None:
    """Same size, other bytes: only a checksum tells (a size check does not)."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_n_is_skipped_for_the_previous_intact_one(tmp_path, caplog):
    checkpoints = tmp_path / "checkpoints"
    commit_folder(checkpoints / "checkpoint_0", steps=2)
    commit_folder(checkpoints / "checkpoint_1", steps=3)
    _flip_a_byte(checkpoints / "checkpoint_1" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger=LOG):
        manifest = load_state(make_run(seed=3).acc, str(checkpoints))
    assert manifest is not None and manifest.step == 2
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint_1" in warned and "checksum" in warned


def test_a_damaged_single_folder_is_refused(tmp_path):
    commit_folder(tmp_path / "ckpt", steps=2)
    _flip_a_byte(tmp_path / "ckpt" / "optimizer.bin")
    with pytest.raises(Exception, match="checksum"):
        load_state(make_run(seed=3).acc, str(tmp_path / "ckpt"))


def test_a_store_whose_committed_generations_are_all_damaged_raises_instead_of_none(tmp_path):
    uri = str(tmp_path / "store")
    run = make_run()
    ckpt = attach(run.acc, uri)
    train(run, 1)
    save_state(run.acc, uri, step=1)
    ckpt.close()
    _flip_a_byte(tmp_path / "store" / "step-00000001" / "model.safetensors")
    with (
        pytest.warns(UserWarning, match="skipping generation"),
        pytest.raises(CheckpointError, match="committed but damaged"),
    ):
        load_state(make_run(seed=2).acc, uri)


def test_only_uncommitted_checkpoint_n_folders_mean_nothing_to_load_with_a_warning(tmp_path, caplog):
    checkpoints = tmp_path / "checkpoints"
    commit_folder(checkpoints / "checkpoint_0", steps=1)
    (checkpoints / "checkpoint_0" / "manifest.json").unlink()  # a first save that never committed
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert load_state(make_run(seed=2).acc, str(checkpoints)) is None
    assert any("checkpoint_0" in r.getMessage() and "no manifest" in r.getMessage() for r in caplog.records)


def test_without_uri_automatic_naming_loads_the_newest_committed_checkpoint_n(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from tests.helpers.accelerate_runs import reset_accelerate

    def automatic_run():
        reset_accelerate()
        config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        acc = Accelerator(cpu=True, project_config=config)
        model = acc.prepare(__import__("torch").nn.Linear(3, 2))
        return acc, model

    acc, _ = automatic_run()
    ckpt = attach(acc)
    acc.save_state()  # checkpoint_0
    acc.save_state()  # checkpoint_1
    ckpt.close()
    (tmp_path / "checkpoints" / "checkpoint_1" / "model.safetensors").write_bytes(b"\0" * 8)  # half-written
    acc, _ = automatic_run()
    manifest = load_state(acc)
    assert manifest is not None
    assert manifest.extra["output_dir"].endswith("checkpoint_0")
    with pytest.raises(CheckpointError, match="automatic_checkpoint_naming"):
        load_state(make_run().acc)


# -- two processes ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_save_state_on_the_main_process_only_raises_instead_of_hanging(tmp_path):
    results = []
    for proc in launch_ranks([sys.executable, __file__, str(tmp_path), "main_only"], timeout=120):
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{"))))
    main, other = results
    assert main["error"] is not None and "every process" in main["error"]
    assert "is_main_process" in main["error"] and "collective_timeout_s" in main["error"]
    assert other["error"] is None  # the other process never made the call
    assert not (tmp_path / "hook" / "manifest.json").exists()


def _worker(out: str, mode: str) -> None:
    import torch.distributed as dist

    run = make_run()
    rank = run.acc.process_index
    attach(run.acc, collective_timeout_s=5)
    train(run, 1)
    error: Any = None
    if mode == "main_only" and run.acc.is_main_process:
        try:
            run.acc.save_state(f"{out}/hook")  # the other process does not call it
        except CheckpointError as exc:
            error = str(exc)
    dist.barrier()  # accelerate's own group: the other process waited here, not in the checkpointer's exchange
    print(json.dumps({"rank": rank, "error": error}), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
