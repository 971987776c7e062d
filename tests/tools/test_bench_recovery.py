"""``bench recovery`` runs end to end on tiny sizes: a restore in a fresh process, a commit, a goodput run.

Only that it runs and reports what it measured; its timings are benchmark figures, never asserted. The smallest
run still starts one training process (a Lightning import), so it takes about 10 s on a quiet 2-core machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_async_ckpt.tools.plan_commands import load_bench


def test_bench_recovery_runs_end_to_end_on_tiny_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "recovery.json"
    argv = ["recovery", "--state-mb", "0.1", "--width", "16", "--repeats", "1", "--tiers", "local"]
    argv += ["--goodput-modes", "one_tier", "--total-steps", "3", "--every", "2", "--local-every", "1"]
    argv += [
        "--step-s",
        "0",
        "--preempt-every",
        "0",
        "--no-peer",
        "--dir",
        str(tmp_path / "scratch"),
        "--json",
        str(out),
    ]
    assert load_bench().main(argv) == 0

    body = json.loads(out.read_text())
    (restore,) = body["restore"]["local"]
    assert restore["total_s"] >= restore["restore_s"] > 0
    assert len(body["commit_s"]["local"]) == 1
    (run,) = body["goodput"]
    assert run["mode"] == "one_tier" and run["preemptions"] == 0 and run["goodput"] >= 0
    table = capsys.readouterr().out
    assert "| local tier (this disk) |" in table and "| one_tier (1) |" in table
