"""No shutdown path crashes the interpreter (issue 13, items 5 and 6).

Each run leaves a save in flight that storage answers only after the shutdown gave up on it, then exits through
normal interpreter finalization: ``close(timeout=...)``, the interpreter-exit drain timing out, and SIGTERM in a
Lightning fit with a short ``drain_timeout_s``. Before the fix these ended with SIGABRT ("terminate called without
an active exception": a daemon thread woken inside ``torch.save``'s C++ frames during finalization) or SIGSEGV.

Runs are forked from two pre-imported zygotes (``tests/helpers/exit_worker.py``), 50 per path. ``LAC_CRASH_RUNS``
overrides the count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "exit_worker.py"
REPO = WORKER.parent.parent
RUNS = int(os.environ.get("LAC_CRASH_RUNS", "50"))
ZYGOTES = 2


def _run_all(lines: list[str], *, lightning: bool) -> list[dict]:
    """Run every ``<mode> <dir>`` line in one of ``ZYGOTES`` forking workers; one result dict per line."""
    results: list[dict | None] = [None] * len(lines)

    def drive(indices: list[int]) -> None:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "serve", *(["lightning"] if lightning else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
        )
        try:
            assert proc.stdout.readline().strip() == "READY"
            for i in indices:
                proc.stdin.write(lines[i] + "\n")
                proc.stdin.flush()
                results[i] = json.loads(proc.stdout.readline())
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)

    threads = [
        threading.Thread(target=drive, args=(list(range(k, len(lines), ZYGOTES)),), name=f"test-zygote-{k}")
        for k in range(ZYGOTES)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results), "a zygote died"
    return results  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 50 forked runs; a Lightning run's finalization alone takes seconds on a busy 2-core box
@pytest.mark.parametrize("mode", ["close", "exit", "sigterm"])
def test_abandoned_save_never_crashes_the_interpreter(tmp_path: Path, mode: str) -> None:
    roots = [tmp_path / f"{mode}-{i}" for i in range(RUNS)]
    results = _run_all([f"{mode} {root}" for root in roots], lightning=mode == "sigterm")
    crashes = [(r["rc"], r["log"]) for r in results if r["rc"] != 0]
    assert not crashes, (
        f"{len(crashes)} of {RUNS} runs crashed: {crashes[:3]}\n" + Path(crashes[0][1]).read_text()[-3000:]
    )
    for root, result in zip(roots, results, strict=True):
        log = Path(result["log"]).read_text()
        if mode == "sigterm":
            # Item 6: the abandoned final save is an ERROR naming the last committed step (step 2 committed).
            assert "ERROR" in log and "abandoned" in log and "last committed step 2" in log, log[-3000:]
            steps = [g.step for g in CheckpointStore(str(root), check_writable=False).generations()]
            assert steps == [2], steps
        else:
            assert "step(s) 1 abandoned, no manifest written; last committed step None" in log, log[-3000:]
            assert CheckpointStore(str(root), check_writable=False).generations() == []
