"""Count the HTTP requests the moto S3 server answers (its werkzeug request log), exactly, server side.

The server runs in a process of its own (``tests/helpers/moto_process.py``) and appends each request's werkzeug log
line to a file before the request's answer goes out. :func:`s3_requests` marks the end of that file when the block
starts and when it ends; the log holds the lines written in between: every request answered while the block ran,
as the in-process log handler used to see them.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.moto_process import LOG_ENV

_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[0-9.]+" (?P<status>\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours the lines of non-200 answers
_TAIL = 1 << 16  # bytes read back from the end of the log at a time to find its last complete line


def _complete_end(path: str) -> int:
    """The offset just past the last complete line of the file (a line still being written is not counted)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = size
        while start > 0:
            start = max(0, start - _TAIL)
            f.seek(start)
            newline = f.read(size - start).rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
    return 0


class RequestLog:
    """Every request line the server logs while installed: ``(method, target, status)``."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._start = _complete_end(path)
        self._end: int | None = None  # None while the block runs: read up to the file's current end

    def close(self) -> None:
        """End the window: requests logged after this are not counted."""
        if self._end is None:
            self._end = _complete_end(self._path)

    @property
    def requests(self) -> list[tuple[str, str, int]]:
        end = self._end if self._end is not None else _complete_end(self._path)
        with open(self._path, "rb") as f:
            f.seek(self._start)
            text = f.read(max(0, end - self._start)).decode("utf-8", "replace")
        found = []
        for line in text.splitlines():
            match = _LINE.search(_ANSI.sub("", line))
            if match:
                found.append((match["method"], match["target"], int(match["status"])))
        return found

    def kind(self, method: str, target: str) -> str:
        """``LIST`` for a listing, else the HTTP method."""
        return "LIST" if method == "GET" and ("list-type=" in target or "delimiter=" in target) else method

    def counts(self) -> Counter[str]:
        """Requests by kind (``LIST``, ``GET``, ``HEAD``, ``PUT``, ``POST``, ``DELETE``)."""
        return Counter(self.kind(m, t) for m, t, _ in self.requests)

    @property
    def total(self) -> int:
        return len(self.requests)


@contextmanager
def s3_requests() -> Iterator[RequestLog]:
    """Record the moto server's requests while the block runs (needs the ``s3_endpoint`` fixture's server)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        raise RuntimeError(f"s3_requests() needs the s3_endpoint fixture's moto server (${LOG_ENV} is not set)")
    log = RequestLog(path)
    try:
        yield log
    finally:
        log.close()
