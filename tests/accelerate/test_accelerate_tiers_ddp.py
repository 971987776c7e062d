"""Two tiers with two Accelerate processes (issue 25): any process's signal makes the next ``save_state`` the
emergency save on both, and ``load_state(..., local_dirpath=...)`` loads one step on both, from the local tier only
when every process holds it intact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from tests.helpers.dist import launch_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "accelerate_tiers_worker.py"


def _phases(base: Path) -> dict[str, list[dict]]:
    """Both phases of the worker in one launch: each phase's results, ordered by rank."""
    results: dict[str, list[dict]] = {}
    for proc in launch_ranks([sys.executable, str(WORKER), str(base)], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                _, phase, body = line.split(" ", 2)
                results.setdefault(phase, []).append(json.loads(body))
    return {phase: sorted(rs, key=lambda r: r["rank"]) for phase, rs in results.items()}


def _steps(uri: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(uri), check_writable=False).generations()]


@pytest.mark.slow
def test_two_processes_stop_together_on_one_signal_and_agree_on_the_tier_to_resume_from(tmp_path: Path) -> None:
    phases = _phases(tmp_path)  # the train phase, then (in the same processes) the resume phase
    trained = phases["train"]
    assert [r["rank"] for r in trained] == [0, 1]
    assert [r["stopped"] for r in trained] == [9, 9]  # process 1 was signalled; both took the emergency save
    assert trained[0]["promoted_step"] == 9  # the main process promoted it within the grace period
    assert _steps(tmp_path / "local") == [2, 4, 6, 8, 9]
    assert _steps(tmp_path / "durable") == [4, 8, 9]
    assert CheckpointStore(str(tmp_path / "durable"), check_writable=False).verify(9).ok
    # Between the phases process 0 copied the shared folder to local-damaged and changed the last 4 bytes of its
    # step 9's model.safetensors (same size, other bytes: only re-reading against the checksum tells).
    assert CheckpointStore(str(tmp_path / "local"), check_writable=False).verify(9).ok
    assert not CheckpointStore(str(tmp_path / "local-damaged"), check_writable=False).verify(9).ok
    resumed = phases["resume"]
    # One node (a shared folder): both processes load step 9 from the local tier.
    assert [r["shared"] for r in resumed] == [{"step": 9, "promoted": False}] * 2
    # Process 1's folder is empty (another node): both fall back to uri, the same step.
    assert [r["own"] for r in resumed] == [{"step": 9, "promoted": True}] * 2
    # Process 1's step 9 is damaged: its newest intact (8) is older than uri's 9, so both load uri's 9.
    assert [r["damaged"] for r in resumed] == [{"step": 9, "promoted": True}] * 2
