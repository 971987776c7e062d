"""The tests' moto S3 server in a process of its own, and the request log it keeps for ``s3_requests.py``.

Run in the pytest process, the server's request threads waited for the GIL that the S3 client (and everything else
the test does) holds: ~56 ms a request at load 5. Here it is a separate interpreter, started once per session by
``tests/conftest.py::s3_endpoint`` through :func:`moto_server`.

The server is moto's own (``DomainDispatcherApplication`` behind werkzeug's threaded server with
``MotoRequestHandler``, as ``moto.server.ThreadedMotoServer`` builds it). Every line werkzeug's request log writes
(``"GET /bucket/key?x=1 HTTP/1.1" 200 -``) is appended to the log file with one ``write`` on an ``O_APPEND`` file,
synchronously in the request's thread: werkzeug logs a request in ``send_response``, before the status line and
headers go out, so a request's line is in the file before its client has its answer. ``RequestLog`` reads the lines
written while it is installed.

Run as ``python tests/helpers/moto_process.py --log PATH``: prints ``PORT <n>`` once it is listening on 127.0.0.1
(``SKIP <reason>`` and exit status 3 when moto's server extras are not installed); it stops on SIGTERM / SIGINT or
when its stdin reaches end of file (the pytest process that holds the other end has gone).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Exit status of a runner that cannot import moto's server (``moto[server]`` not installed).
SKIP_STATUS = 3
#: How long the session waits for the runner to print its port (moto's import takes 1-3 s on a quiet machine).
START_TIMEOUT_S = 120.0
#: How long the runner gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10.0
#: The environment variable naming the request log of the session's server (read by ``s3_requests.py``).
LOG_ENV = "LAC_TEST_MOTO_REQUEST_LOG"


class MotoUnavailable(RuntimeError):
    """The runner could not import moto's server; the message says what is missing."""


class _LineFile(logging.Handler):
    """Append each record's message as one line, with one ``os.write`` on an ``O_APPEND`` descriptor."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage().rstrip("\n").replace("\n", " ") + "\n"
        os.write(self._fd, line.encode("utf-8", "backslashreplace"))  # the handler's lock orders the threads


def _serve(log_path: str) -> int:
    try:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server
    except ImportError as exc:
        print(f"SKIP moto[server] is needed for S3 tests ({exc})", flush=True)
        return SKIP_STATUS

    logger = logging.getLogger("werkzeug")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(_LineFile(log_path))
    errors = logging.StreamHandler(sys.stderr)  # what the in-process server showed: warnings and errors only
    errors.setLevel(logging.WARNING)
    logger.addHandler(errors)

    server = make_server(
        "127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), True, request_handler=MotoRequestHandler
    )

    def stop(*_: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    def stop_at_eof() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=stop_at_eof, name="stdin-eof", daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # nobody reads the pipe after the port line
    server.serve_forever()
    server.server_close()
    return 0


@contextmanager
def moto_server(log_path: Path) -> Iterator[str]:
    """Start the runner with this process's environment; yield ``http://127.0.0.1:<port>``; stop it after.

    Raises:
        MotoUnavailable: moto's server extras are not installed.
        RuntimeError: the runner exited or printed something else before its port (its stderr is shown).
    """
    log_path.touch()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--log", str(log_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = _first_line(proc)
        if first.startswith("SKIP "):
            raise MotoUnavailable(first.removeprefix("SKIP "))
        if not first.startswith("PORT "):
            raise RuntimeError(f"the moto server process printed {first!r} instead of its port (exit {proc.poll()})")
        yield f"http://127.0.0.1:{int(first.split()[1])}"
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _first_line(proc: subprocess.Popen[str]) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout=START_TIMEOUT_S)
    if not result:
        raise RuntimeError(f"the moto server process printed no port within {START_TIMEOUT_S:.0f} s")
    return result[0].strip()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="file the request lines are appended to")
    sys.exit(_serve(parser.parse_args().log))
