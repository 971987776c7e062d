"""Two-process DDP on CPU with a local tier: the ranks agree on the step they resume from."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from tests.helpers.dist import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "tiers_ddp_worker.py"
pytestmark = pytest.mark.slow


def _run(base: Path, layout: str, phase: str) -> list[dict]:
    return run_ranks(WORKER, base, layout, phase, timeout=180)


def _steps(path: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(path), check_writable=False).generations()]


@pytest.mark.parametrize(("layout", "resumed_step"), [("shared", 6), ("per_rank", 4)])
def test_every_rank_resumes_from_the_same_tier(tmp_path, layout, resumed_step):
    _run(tmp_path, layout, "train")
    local = tmp_path / ("local" if layout == "shared" else "local-rank0")
    assert _steps(local) == [2, 4, 6] and _steps(tmp_path / "durable") == [4]
    r0, r1 = _run(tmp_path, layout, "resume")
    # One node: both ranks read the local step 6. Two nodes: only rank 0's node has the local generations, so both
    # ranks resume from dirpath's step 4 together.
    assert r0["ckpt_path"] == r1["ckpt_path"]
    assert r0["ckpt_path"].endswith(f"step={resumed_step}.ckpt")
    assert _steps(tmp_path / "durable") == [4, 8]
