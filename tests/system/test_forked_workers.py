"""The test harness itself: ``tests/helpers/forked.py``'s handle on a worker, forked from the zygote or fresh.

The killed and signalled workers of the shutdown, store and crash-matrix tests go through it, so what they assert
about exit statuses and printed lines rests on these: a line is read as soon as it is printed, stdin stays open
until written to, a signal's exit status is negative, ``sys.exit`` goes through interpreter exit (atexit handlers
run), and a timeout kills the worker and says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import dist
from tests.helpers.forked import start_script

_SCRIPT = textwrap.dedent(
    """
    import atexit
    import os
    import sys
    import threading

    atexit.register(lambda: print("ATEXIT", flush=True))
    print("READY", os.getppid(), flush=True)
    command = sys.stdin.readline().split()
    if command[0] == "exit":
        sys.exit(int(command[1]))
    threading.Event().wait()  # "hang": until killed
    """
)


@pytest.fixture(params=["forked", "fresh"])
def script(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    if request.param == "fresh":
        monkeypatch.setenv("LAC_FRESH_RANKS", "1")
    path = tmp_path / "worker.py"
    path.write_text(_SCRIPT)
    return [sys.executable, str(path)]


def _parent(line: str, forked: bool) -> None:
    word, ppid = line.split()
    assert word == "READY"
    if forked:  # it really was forked from the session's zygote, not started by this process
        assert dist._zygote is not None and int(ppid) == dist._zygote.proc.pid
    else:
        assert int(ppid) == os.getpid()


def test_a_line_then_stdin_then_exit_through_the_interpreter(script: list[str]) -> None:
    forked = os.environ.get("LAC_FRESH_RANKS") != "1"
    with start_script(script, stdin=True) as proc:
        _parent(proc.readline(timeout=120), forked)
        proc.write("exit 3\n")
        assert proc.wait(timeout=120) == 3, proc.stderr
    assert proc.stdout == "ATEXIT\n"  # the atexit handler ran: it left through interpreter exit


def test_a_signal_ends_it_with_a_negative_status(script: list[str]) -> None:
    with start_script(script, stdin=True) as proc:
        assert proc.readline(timeout=120).startswith("READY")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM
    assert proc.stdout == ""  # no interpreter exit after SIGTERM's default action


def test_timeouts_raise_and_the_wait_kills_it(script: list[str]) -> None:
    with start_script(script, stdin=True) as proc:
        assert proc.readline(timeout=120).startswith("READY")
        proc.write("hang\n")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.readline(timeout=0.1)  # it prints nothing more until killed
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        assert proc.returncode == -signal.SIGKILL


def test_leaving_the_block_kills_a_worker_still_running(script: list[str]) -> None:
    with start_script(script, stdin=True) as proc:
        assert proc.readline(timeout=120).startswith("READY")
    assert proc.returncode == -signal.SIGKILL
