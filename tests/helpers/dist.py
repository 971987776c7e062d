"""Launching a script as several torch.distributed ranks on CPU (gloo), for the multi-process tests.

The ranks are forked from one pre-imported zygote per pytest session (``tests/helpers/rank_zygote.py``: torch,
torch.distributed, Lightning and this package imported once), not started as fresh interpreters: the imports were
most of a launch's time. Each rank is otherwise the process ``python <script> <args>`` would be (its environment,
working directory, ``sys.argv``, exit through interpreter finalization; its exit status and output as before).
``LAC_FRESH_RANKS=1`` starts fresh interpreters instead, as before; so does a zygote that cannot start.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ZYGOTE = Path(__file__).resolve().parent / "rank_zygote.py"
#: The zygote's imports take ~10-20 s on the busy 2-core machine; past this it is given up (fresh interpreters).
ZYGOTE_START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """The environment of one externally launched rank (what torchrun would set), one thread per process."""
    return dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )


class _Zygote:
    """The session's rank zygote: spawn a rank, wait for one (see ``rank_zygote.py`` for the protocol)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)], env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        if self._readline(ZYGOTE_START_TIMEOUT_S) != "READY":
            self.close()
            raise RuntimeError("the rank zygote did not start")

    def _readline(self, timeout: float | None) -> str | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank zygote died (exit status {self.proc.poll()})")
        return line.strip()

    def _ask(self, request: dict, timeout: float | None = None) -> dict | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self._readline(timeout)
        return None if line is None else json.loads(line)

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: Path,
        stderr: Path,
        cwd: str | Path | None,
        stdin: Path | None = None,
        fast_exit: bool = False,
    ) -> int:
        spec = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(stdout), "stderr": str(stderr)}
        if stdin is not None:
            spec["stdin"] = str(stdin)
        if fast_exit:
            spec["fast_exit"] = True
        answer = self._ask({"spawn": spec})
        assert answer is not None
        return answer["pid"]

    def wait_send(self, pid: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"wait": pid}) + "\n")
        self.proc.stdin.flush()

    def wait_answer(self, timeout: float | None) -> int | None:
        line = self._readline(timeout)
        return None if line is None else json.loads(line)["rc"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()  # not left to interpreter exit (an "unclosed file" ResourceWarning there)
            except OSError:  # a request still buffered for the killed zygote: nothing reads it
                pass


_zygote: _Zygote | None = None
_zygote_failed = False
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote | None:
    global _zygote, _zygote_failed
    if os.environ.get("LAC_FRESH_RANKS") == "1" or _zygote_failed:
        return None
    if _zygote is None or _zygote.proc.poll() is not None:
        try:
            _zygote = _Zygote()
        except (OSError, RuntimeError):
            _zygote_failed = True
            return None
        atexit.register(_zygote.close)
    return _zygote


def _a_script(argv: list[str]) -> bool:
    """``[sys.executable, script, ...]``: what the zygote can fork (not ``-c``, ``-m`` or other interpreters)."""
    return len(argv) >= 2 and argv[0] == sys.executable and not argv[1].startswith("-")


def _run_forked(
    zygote: _Zygote,
    argv: list[str],
    envs: list[dict[str, str]],
    timeout: float,
    cwd: str | Path | None = None,
    fast_exit: bool = False,
) -> tuple[list[subprocess.CompletedProcess], bool]:
    """One process per environment, forked from ``zygote``; their results and whether one hung (all killed)."""
    global _zygote
    folder = Path(tempfile.mkdtemp(prefix="lac-ranks-"))
    pids: list[int] = []
    codes: list[int] = []  # of pids[: len(codes)], reaped: their pids may be reused, never signal them
    try:
        pids = [
            zygote.spawn(argv, env, folder / f"{rank}.out", folder / f"{rank}.err", cwd, fast_exit=fast_exit)
            for rank, env in enumerate(envs)
        ]
        hung = False
        for pid in pids:
            zygote.wait_send(pid)
            code = zygote.wait_answer(None if hung else timeout)
            if code is None:  # this rank hung: kill every rank, then take the pending answer
                hung = True
                for other in pids[len(codes) :]:
                    try:
                        os.kill(other, 9)
                    except ProcessLookupError:
                        pass
                code = zygote.wait_answer(None)
            codes.append(code)
        results = [
            subprocess.CompletedProcess(
                argv,
                code,
                (folder / f"{rank}.out").read_text(errors="replace"),
                (folder / f"{rank}.err").read_text(errors="replace"),
            )
            for rank, code in enumerate(codes)
        ]
    except BaseException:
        # Interrupted (a pytest timeout, Ctrl-C) or the zygote broke: the protocol may be out of step. Kill the
        # ranks and this zygote; the next launch starts a new one.
        for pid in pids[len(codes) :]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        zygote.close()
        _zygote = None
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results, hung


def run_script(argv: list[str], *, timeout: float, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)`` for ``[sys.executable, script, ...]``,
    forked from the session's zygote (this process's environment, as ``subprocess.run`` passes it): the same exit
    status (negative for a signal) and output; a process still running after ``timeout`` is killed and
    ``subprocess.TimeoutExpired`` raised; in ``cwd`` (default: this process's). ``LAC_FRESH_RANKS=1`` runs a fresh
    interpreter, as before."""
    with _zygote_lock:
        zygote = _the_zygote() if _a_script(argv) else None
        if zygote is not None:
            (result,), hung = _run_forked(zygote, argv, [dict(os.environ)], timeout, cwd)
            if hung:
                raise subprocess.TimeoutExpired(argv, timeout, result.stdout, result.stderr)
            return result
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def launch_ranks(
    argv: list[str], *, timeout: float, world_size: int = 2, fail_on_hang: bool = True
) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` once per rank, wait for all; a rank that hangs past ``timeout`` fails the test (all are killed).

    ``argv`` is ``[sys.executable, script, *args]``. With ``fail_on_hang=False`` a hang kills every rank too, but
    the ranks' outputs so far are returned (a killed rank's return code is ``-9``), so a caller running several
    scenarios can say which one hung.
    """
    import pytest

    port = free_port()
    with _zygote_lock:
        zygote = _the_zygote() if _a_script(argv) else None
        if zygote is not None:
            envs = [rank_env(rank, port, world_size) for rank in range(world_size)]
            # Ranks are training scenarios, not tests of interpreter teardown: they end after the exit handlers
            # (threads joined, atexit run) without tearing down the zygote's imported heap (~2 s per rank).
            results, hung = _run_forked(zygote, argv, envs, timeout, fast_exit=True)
            if hung and fail_on_hang:
                pytest.fail("a rank hung instead of finishing or failing")
            return results
    procs = [
        subprocess.Popen(
            argv,
            env=rank_env(rank, port, world_size),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(world_size)
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            if fail_on_hang:
                pytest.fail("a rank hung instead of finishing or failing")
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def rank_results(procs: list[subprocess.CompletedProcess]) -> list[dict]:
    """Each rank's last ``RESULT <json>`` line, parsed, after asserting that every rank exited with 0."""
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT ") :]))
    return results


def run_ranks(script: Path | str, *args: object, timeout: float, world_size: int = 2) -> list[dict]:
    """``python script *args`` once per rank (:func:`launch_ranks`), then each rank's :func:`rank_results`."""
    argv = [sys.executable, str(script), *(str(a) for a in args)]
    return rank_results(launch_ranks(argv, timeout=timeout, world_size=world_size))
