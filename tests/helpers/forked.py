"""A ``subprocess.Popen``-like handle on ``python <script> <args>`` forked from the session's zygote.

For tests that talk to a running worker: read a line it prints, signal or kill it, then wait for its exit status.
``tests.helpers.dist.run_script`` covers run-to-completion; this covers the rest. The child is what
``tests/helpers/rank_zygote.py`` makes of a spawn (its own environment, working directory, ``sys.argv``, the script
run as ``__main__``, exit through ``sys.exit`` and interpreter finalization, a real separate process that a signal
or SIGKILL ends), with its stdout (and, with ``stdin=True``, its stdin) connected to this process through FIFOs, so
lines are read as the child prints them. ``LAC_FRESH_RANKS=1``, a ``-c`` / ``-m`` command line or a zygote that
cannot start run a fresh interpreter (``subprocess.Popen``) behind the same handle.

Usage::

    with start_script([sys.executable, worker, arg], cwd=REPO) as proc:
        assert proc.readline(timeout=120).startswith("READY")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr
    proc.stdout  # everything it printed after the lines read
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import dist


class Worker:
    """A started worker: ``pid``, ``readline``, ``wait``; ``stdout`` / ``stderr`` once it exited."""

    def __init__(self, argv: list[str], folder: Path, out_fd: int) -> None:
        self.args = argv
        self.pid = -1
        self.returncode: int | None = None
        self.stdout = ""  # what was printed after the lines ``readline`` returned, set by ``wait``
        self._folder = folder
        self._out_fd = out_fd
        self._buffer = b""
        self._eof = False
        self._stdin_fd: int | None = None
        self._zygote: dist._Zygote | None = None
        self._popen: subprocess.Popen | None = None

    @property
    def stderr(self) -> str:
        """What the worker wrote to stderr so far."""
        return (self._folder / "stderr").read_text(errors="replace")

    def _fill(self, deadline: float | None) -> bool:
        """Read what the child wrote; False when ``deadline`` passed first."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([self._out_fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self._out_fd, 1 << 16)
        except BlockingIOError:  # woken without data (the writer not connected yet): try again
            return True
        if data:
            self._buffer += data
        else:
            self._eof = True
        return True

    def readline(self, timeout: float) -> str:
        """The next line the worker prints (``""`` at end of output); ``TimeoutExpired`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer and not self._eof:
            if not self._fill(deadline):
                raise subprocess.TimeoutExpired(self.args, timeout, self._buffer.decode(errors="replace"))
        line, sep, rest = self._buffer.partition(b"\n")
        self._buffer = rest
        return (line + sep).decode(errors="replace")

    def wait(self, timeout: float) -> int:
        """Read its output to the end and reap it; its exit status (negative for a signal), as ``Popen.wait``.

        Past ``timeout`` it is killed (SIGKILL), reaped and ``subprocess.TimeoutExpired`` raised.
        """
        if self.returncode is not None:
            return self.returncode
        deadline = time.monotonic() + timeout
        hung = False
        while not self._eof:
            if not self._fill(deadline):
                hung = True
                os.kill(self.pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
                deadline = None
        self.returncode = self._reap()
        self.stdout = self._buffer.decode(errors="replace")
        if hung:
            raise subprocess.TimeoutExpired(self.args, timeout, self.stdout, self.stderr)
        return self.returncode

    def write(self, text: str) -> None:
        """Write ``text`` to the worker's stdin (started with ``stdin=True``)."""
        assert self._stdin_fd is not None, "start_script(..., stdin=True) gives the worker a stdin to write to"
        data = text.encode()
        while data:
            data = data[os.write(self._stdin_fd, data) :]

    def _reap(self) -> int:
        if self._popen is not None:
            return self._popen.wait()
        assert self._zygote is not None
        with dist._zygote_lock:
            self._zygote.wait_send(self.pid)
            try:
                code = self._zygote.wait_answer(None)
            except BaseException:
                # Interrupted inside the exchange (a pytest timeout, Ctrl-C): the protocol is out of step. Kill
                # the worker and this zygote; the next user starts a new one.
                _kill(self.pid)
                self._zygote.close()
                if dist._zygote is self._zygote:
                    dist._zygote = None
                self.returncode = -signal.SIGKILL
                raise
        assert code is not None
        return code

    def _close(self) -> None:
        """Kill it if it still runs, reap it and close this side's ends."""
        try:
            if self.returncode is None and self.pid > 0:
                _kill(self.pid)  # not reaped yet: the pid is still this worker's
                self.wait(timeout=60)
        finally:
            for fd in (self._out_fd, self._stdin_fd):
                if fd is not None:
                    os.close(fd)


@contextmanager
def start_script(
    argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None, stdin: bool = False
) -> Iterator[Worker]:
    """Start ``argv`` (``[sys.executable, script, *args]``), forked from the session's zygote; see the module doc.

    ``env`` defaults to this process's environment; ``stdin=True`` gives the worker a stdin that stays open (a read
    blocks until ``write``) until the block ends, instead of ``/dev/null``. Leaving the block kills a worker still
    running (and reaps it).
    """
    env = dict(os.environ if env is None else env)
    folder = Path(tempfile.mkdtemp(prefix="lac-worker-"))
    out_path, in_path, err_path = folder / "stdout", folder / "stdin", folder / "stderr"
    os.mkfifo(out_path)
    # Opened before the worker exists, so its opens do not block: select() on this end waits for its output (Linux
    # reports no hang-up on a FIFO before a writer connected), and this writer keeps its stdin open.
    worker = Worker(argv, folder, os.open(out_path, os.O_RDONLY | os.O_NONBLOCK))
    if stdin:
        os.mkfifo(in_path)
        worker._stdin_fd = os.open(in_path, os.O_RDWR)
    try:
        with dist._zygote_lock:
            zygote = dist._the_zygote() if dist._a_script(argv) else None
            if zygote is not None:
                worker._zygote = zygote
                worker.pid = zygote.spawn(argv, env, out_path, err_path, cwd, stdin=in_path if stdin else None)
        if zygote is None:
            ends = [os.open(in_path if stdin else os.devnull, os.O_RDONLY), os.open(out_path, os.O_WRONLY)]
            try:
                with open(err_path, "wb") as err:
                    worker._popen = subprocess.Popen(argv, stdin=ends[0], stdout=ends[1], stderr=err, cwd=cwd, env=env)
            finally:
                for fd in ends:
                    os.close(fd)
            worker.pid = worker._popen.pid
        yield worker
    finally:
        try:
            worker._close()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
