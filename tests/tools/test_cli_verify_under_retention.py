"""``lightning-async-ckpt verify`` while a running writer's retention removes a generation it listed: that generation
is reported as removed, not as damaged, and the exit status says nothing failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tools.cli import main
from tests.helpers.gate import Gate, run_gated


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", f"step {step}".encode())
    writer.commit()
    store.gc(1)


def test_a_generation_retired_while_verify_reads_it_is_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    root = str(tmp_path / "ckpt")
    writer = CheckpointStore(root, run_id="writer")
    _commit(writer, 1)
    gate = Gate(monkeypatch, writer.fs, "info", lambda path: path.endswith("step-00000001/checkpoint.ckpt"))
    assert run_gated(gate, lambda: main(["verify", root]), lambda: _commit(writer, 2)) == 0
    out = capsys.readouterr().out
    assert "step 1: removed while it was verified" in out, out
