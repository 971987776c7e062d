"""``load_state`` of ``checkpoint_N`` folders while accelerate's own retention (``total_limit=1``) removes the folder
it chose: it lists again and loads the newer one, never "nothing to load" nor an error.

The reader is held right before it stats the chosen folder's weights; meanwhile a newer committed folder appears and
the chosen one is removed as accelerate removes it (``shutil.rmtree``).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state  # noqa: E402
from lightning_async_ckpt.storage.regular import url_to_regular_fs  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402
from tests.helpers.gate import JOIN_S, Gate, run_gated  # noqa: E402


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


def test_a_first_save_committing_while_load_state_looks_is_loaded_not_called_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store held only the first save in progress when ``latest()`` looked; it commits before ``load_state``
    asks why nothing was intact: that is a commit, not damage."""
    from lightning_async_ckpt import CheckpointStore
    from lightning_async_ckpt.accelerate import save_state

    uri = str(tmp_path / "store")
    run = make_run()
    ckpt = attach(run.acc, uri, keep_last=None)
    train(run, 2)
    save_state(run.acc, uri)
    ckpt.close()
    manifest = tmp_path / "store" / "step-00000002" / "manifest.json"
    aside = tmp_path / "manifest.json"
    manifest.rename(aside)  # the first save, still in flight: no manifest yet
    held, release = threading.Event(), threading.Event()
    reader: list[threading.Thread] = []
    latest = CheckpointStore.latest

    def gated_latest(self: CheckpointStore, *args: Any, **kwargs: Any) -> Any:
        info = latest(self, *args, **kwargs)
        if reader and threading.current_thread() is reader[0] and info is None and not held.is_set():
            held.set()
            assert release.wait(JOIN_S)
        return info

    monkeypatch.setattr(CheckpointStore, "latest", gated_latest)
    result: dict[str, Any] = {}
    resumed = make_run(seed=8)

    def load() -> None:
        try:
            result["value"] = load_state(resumed.acc, uri)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            result["error"] = exc

    reader.append(threading.Thread(target=load, name="test-reader"))
    reader[0].start()
    try:
        assert held.wait(JOIN_S), "load_state never found the store without a commit"
        aside.rename(manifest)  # the first save commits
    finally:
        release.set()
        reader[0].join(JOIN_S)
    assert "error" not in result, result.get("error")
    assert result["value"] is not None and result["value"].step == 2
