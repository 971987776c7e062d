"""Non-regular files in a store (FIFOs here; sockets and devices take the same path) are refused from ``lstat``
without being opened: readers, the CLI and a writer reaching that step never hang on them, and ``ls``, ``verify``
and ``gc`` name what they skipped.

Every call runs in a thread bounded by :data:`BOUND_S`; if it is still blocked (a regression), the FIFOs' other ends
are opened to release it and the test fails, so a regression never hangs the suite.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_async_ckpt import latest_checkpoint
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tools.cli import main

BOUND_S = 60.0
pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs need a POSIX system")


def _release(fifo: Path) -> None:
    for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(fifo, flags))  # a blocked reader sees EOF, a blocked writer a closed pipe
        except OSError:
            pass


def bounded(call: Callable[[], Any], fifos: list[Path]) -> Any:
    """``call()`` in a thread; fail (after releasing it) when it blocks past :data:`BOUND_S`."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
            result["error"] = exc

    thread = threading.Thread(target=run, name="test-fifo-reader", daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        while thread.is_alive():
            for fifo in fifos:
                _release(fifo)
            thread.join(1.0)
        pytest.fail(f"blocked on a FIFO for more than {BOUND_S:g}s (released by the test)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _commit(store: CheckpointStore, step: int, data: bytes | None = None) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", f"step {step}".encode() if data is None else data)
    writer.commit()


def _fifo_at(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def test_a_fifo_manifest_is_skipped_by_latest_and_latest_checkpoint(root: Path) -> None:
    store = CheckpointStore(str(root), run_id="run")
    _commit(store, 1)
    _commit(store, 2)
    fifo = _fifo_at(root / "step-00000002" / "manifest.json")
    with pytest.warns(UserWarning, match="FIFO"):
        info = bounded(CheckpointStore(str(root), check_writable=False).latest, [fifo])
    assert info.step == 1
    assert bounded(lambda: latest_checkpoint(str(root)), [fifo]).endswith("step-00000001/checkpoint.ckpt")


def test_a_fifo_object_under_a_resigned_manifest_is_never_opened(root: Path, capsys: pytest.CaptureFixture) -> None:
    store = CheckpointStore(str(root), run_id="run")
    _commit(store, 1)
    _commit(store, 2, data=b"")  # the manifest lists an empty object: a FIFO's size matches it
    fifo = _fifo_at(root / "step-00000002" / "checkpoint.ckpt")
    with pytest.warns(UserWarning, match="FIFO"):
        assert bounded(CheckpointStore(str(root), check_writable=False).latest, [fifo]).step == 1
    assert bounded(lambda: latest_checkpoint(str(root)), [fifo]).endswith("step-00000001/checkpoint.ckpt")
    assert bounded(lambda: main(["verify", str(root)]), [fifo]) == 1
    out = capsys.readouterr().out
    assert "step 2: FAILED" in out and "FIFO" in out, out


def test_ls_names_fifos_and_never_opens_them(root: Path, capsys: pytest.CaptureFixture) -> None:
    store = CheckpointStore(str(root), run_id="run")
    _commit(store, 1)
    _commit(store, 2)
    fifos = [_fifo_at(root / "step-00000002" / "manifest.json"), _fifo_at(root / "step-00000009")]
    assert bounded(lambda: main(["ls", str(root)]), fifos) == 0
    out = capsys.readouterr().out
    assert "skipped step-00000009: a FIFO" in out, out
    assert "step 2: manifest rejected" in out and "FIFO" in out, out


def test_gc_never_opens_a_fifo_and_names_what_it_skipped(root: Path, capsys: pytest.CaptureFixture) -> None:
    store = CheckpointStore(str(root), run_id="run")
    _commit(store, 2)
    _commit(store, 3)
    leftover = root / "step-00000001"
    leftover.mkdir()
    fifos = [_fifo_at(leftover / ".writer.json"), _fifo_at(root / "step-00000009")]
    assert bounded(lambda: main(["gc", str(root), "--keep-last", "1"]), fifos) == 0
    out = capsys.readouterr().out
    assert "skipped step-00000009: a FIFO" in out, out
    assert [g.step for g in CheckpointStore(str(root), check_writable=False).generations()] == [3]


@pytest.mark.parametrize("name", ["manifest.json", ".writer.json"])
def test_a_writer_reaching_a_step_holding_a_fifo_commits(root: Path, name: str) -> None:
    store = CheckpointStore(str(root), run_id="run")
    _commit(store, 1)
    (root / "step-00000002").mkdir()
    fifo = _fifo_at(root / "step-00000002" / name)
    bounded(lambda: _commit(store, 2), [fifo])
    info = bounded(CheckpointStore(str(root), check_writable=False).latest, [fifo])
    assert info.step == 2
