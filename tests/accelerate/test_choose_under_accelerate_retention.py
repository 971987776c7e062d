"""``load_state`` of ``checkpoint_N`` folders while accelerate's own retention (``total_limit=1``) removes the folder
it chose: it lists again and loads the newer one, never "nothing to load" nor an error.

The reader is held right before it stats the chosen folder's weights; meanwhile a newer committed folder appears and
the chosen one is removed as accelerate removes it (``shutil.rmtree``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state  # noqa: E402
from lightning_async_ckpt.storage.regular import url_to_regular_fs  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402
from tests.helpers.gate import Gate, run_gated  # noqa: E402


def test_a_chosen_checkpoint_n_removed_under_the_reader_is_replaced_by_the_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoints = tmp_path / "project" / "checkpoints"
    run = make_run()
    ckpt = attach(run.acc)
    train(run, 2)
    run.acc.save_state(str(checkpoints / "checkpoint_0"))
    train(run, 2)
    run.acc.save_state(str(tmp_path / "next"))  # the next save, committed, moved into place below
    ckpt.close()
    fs = url_to_regular_fs(str(checkpoints))[0]
    gate = Gate(monkeypatch, fs, "info", lambda path: path.endswith("checkpoint_0/model.safetensors"))

    def next_save_and_total_limit() -> None:
        shutil.move(tmp_path / "next", checkpoints / "checkpoint_1")
        shutil.rmtree(checkpoints / "checkpoint_0")

    resumed = make_run(seed=8)
    manifest = run_gated(gate, lambda: load_state(resumed.acc, str(checkpoints)), next_save_and_total_limit)
    assert manifest is not None and manifest.step == 4
