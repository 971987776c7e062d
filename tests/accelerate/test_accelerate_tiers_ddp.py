"""Two tiers with two Accelerate processes (issue 25): any process's signal makes the next ``save_state`` the
emergency save on both, and ``load_state(..., local_dirpath=...)`` loads one step on both, from the local tier only
when every process holds it intact."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from tests.helpers.dist import launch_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "accelerate_tiers_worker.py"


def _phase(base: Path, phase: str) -> list[dict]:
    results = []
    for proc in launch_ranks([sys.executable, str(WORKER), str(base), phase], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return sorted(results, key=lambda r: r["rank"])


def _steps(uri: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(uri), check_writable=False).generations()]


@pytest.mark.slow
def test_two_processes_stop_together_on_one_signal_and_agree_on_the_tier_to_resume_from(tmp_path: Path) -> None:
    trained = _phase(tmp_path, "train")
    assert [r["stopped"] for r in trained] == [9, 9]  # process 1 was signalled; both took the emergency save
    assert trained[0]["promoted_step"] == 9  # the main process promoted it within the grace period
    assert _steps(tmp_path / "local") == [2, 4, 6, 8, 9]
    assert _steps(tmp_path / "durable") == [4, 8, 9]
    assert CheckpointStore(str(tmp_path / "durable"), check_writable=False).verify(9).ok
    shutil.copytree(tmp_path / "local", tmp_path / "local-damaged")
    with open(tmp_path / "local-damaged" / "step-00000009" / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")  # same size, other bytes: only re-reading against the checksum tells
    resumed = _phase(tmp_path, "resume")
    # One node (a shared folder): both processes load step 9 from the local tier.
    assert [r["shared"] for r in resumed] == [{"step": 9, "promoted": False}] * 2
    # Process 1's folder is empty (another node): both fall back to uri, the same step.
    assert [r["own"] for r in resumed] == [{"step": 9, "promoted": True}] * 2
    # Process 1's step 9 is damaged: its newest intact (8) is older than uri's 9, so both load uri's 9.
    assert [r["damaged"] for r in resumed] == [{"step": 9, "promoted": True}] * 2
