"""Count the HTTP requests the moto S3 server answers (its werkzeug request log), exactly, server side."""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[0-9.]+" (?P<status>\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours the lines of non-200 answers


class RequestLog(logging.Handler):
    """Every request line the server logs while installed: ``(method, target, status)``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.requests: list[tuple[str, str, int]] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        match = _LINE.search(_ANSI.sub("", record.getMessage()))
        if match:
            with self._guard:
                self.requests.append((match["method"], match["target"], int(match["status"])))

    def kind(self, method: str, target: str) -> str:
        """``LIST`` for a listing, else the HTTP method."""
        return "LIST" if method == "GET" and ("list-type=" in target or "delimiter=" in target) else method

    def counts(self) -> Counter[str]:
        """Requests by kind (``LIST``, ``GET``, ``HEAD``, ``PUT``, ``POST``, ``DELETE``)."""
        with self._guard:
            return Counter(self.kind(m, t) for m, t, _ in self.requests)

    @property
    def total(self) -> int:
        with self._guard:
            return len(self.requests)


@contextmanager
def s3_requests() -> Iterator[RequestLog]:
    """Record the moto server's requests while the block runs (the server logs through ``werkzeug``)."""
    logger = logging.getLogger("werkzeug")
    handler = RequestLog()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
