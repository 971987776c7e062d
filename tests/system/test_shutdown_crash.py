"""No shutdown path crashes the interpreter (issue 13, items 5 and 6).

Each run leaves a save in flight that storage answers only after the shutdown gave up on it, then exits through
normal interpreter finalization: ``close(timeout=...)``, the interpreter-exit drain timing out, and SIGTERM in a
Lightning fit with a short ``drain_timeout_s``. Before the fix these ended with SIGABRT ("terminate called without
an active exception": a daemon thread woken inside ``torch.save``'s C++ frames during finalization) or SIGSEGV.

Runs are forked from pre-imported zygotes (``tests/helpers/exit_worker.py``, two per kind, shared by the paths of
this module), ``RUNS`` per path: 8 by default, which on the code before the fix crashed in every path every time
(each run crashed there with probability 0.6-1.0, measured on the busy 2-core machine; docs/reliability.md).
``LAC_CRASH_RUNS=50`` runs the long matrix the fix was proven with. ``LAC_ROOT`` points the workers at another
checkout of the library (how the default was checked against the code before the fix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "exit_worker.py"
REPO = WORKER.parent.parent
RUNS = int(os.environ.get("LAC_CRASH_RUNS", "8"))
ZYGOTES = 2


class Zygotes:
    """``ZYGOTES`` forking workers of one kind (with or without Lightning preloaded), started once per module."""

    def __init__(self, lightning: bool) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), "serve", *(["lightning"] if lightning else [])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(REPO),
            )
            for _ in range(ZYGOTES)
        ]
        for proc in self.procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"

    def run_all(self, lines: list[str]) -> list[dict]:
        """Run every ``<mode> <dir>`` line in one of the zygotes; one result dict per line."""
        results: list[dict | None] = [None] * len(lines)

        def drive(proc: subprocess.Popen, indices: list[int]) -> None:
            assert proc.stdin is not None and proc.stdout is not None
            for i in indices:
                proc.stdin.write(lines[i] + "\n")
                proc.stdin.flush()
                results[i] = json.loads(proc.stdout.readline())

        threads = [
            threading.Thread(target=drive, args=(proc, list(range(k, len(lines), ZYGOTES))), name=f"test-zygote-{k}")
            for k, proc in enumerate(self.procs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r is not None for r in results), "a zygote died"
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygotes() -> Iterator[Callable[[bool], Zygotes]]:
    """The zygotes of a kind (``True``: Lightning preloaded), started on first use and shared by the paths."""
    started: dict[bool, Zygotes] = {}

    def get(lightning: bool) -> Zygotes:
        if lightning not in started:
            started[lightning] = Zygotes(lightning)
        return started[lightning]

    try:
        yield get
    finally:
        for z in started.values():
            z.close()


@pytest.mark.slow
@pytest.mark.timeout(1500)  # LAC_CRASH_RUNS=50: a Lightning run's finalization alone takes seconds on a busy 2-core box
@pytest.mark.parametrize("mode", ["close", "exit", "sigterm"])
def test_abandoned_save_never_crashes_the_interpreter(
    tmp_path: Path, mode: str, zygotes: Callable[[bool], Zygotes]
) -> None:
    roots = [tmp_path / f"{mode}-{i}" for i in range(RUNS)]
    results = zygotes(mode == "sigterm").run_all([f"{mode} {root}" for root in roots])
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
