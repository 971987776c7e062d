"""Retrying one rank's object writes when the object store throttles it: bounded, with jittered backoff.

:class:`WriteRetries` retries a write that failed as :func:`~lightning_async_ckpt.storage.throttling.is_throttled`
says, at most ``policy.retries`` times, and counts the retries (the manifest's ``extra["write_retries"]``); anything
else fails at once.

Thread-safety: one instance per rank's ``write_data``; :meth:`WriteRetries.run` may be called from several threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.storage.throttling import is_throttled

__all__ = ["DEFAULT_WRITE_RETRY", "WriteRetries", "is_throttled"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

#: Four retries after 0.5, 1, 2 and 4 s (each up to half again longer): about 8-12 s of throttling ridden out.
DEFAULT_WRITE_RETRY = RetryPolicy(retries=4, backoff_s=0.5)


class WriteRetries:
    """Runs object writes with bounded retries on throttling, and counts the retries.

    Args:
        policy: How many retries and the backoff (``retries`` and ``backoff_s``; ``DEFAULT_WRITE_RETRY`` when
            ``None``).
        sleep: What waits out the backoff (``time.sleep``).
    """

    def __init__(self, policy: RetryPolicy | None = None, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy or DEFAULT_WRITE_RETRY
        self._sleep = sleep
        self._lock = threading.Lock()
        self.count = 0

    def run(self, write: Callable[[], T], *, undo: Callable[[], None], what: str) -> T:
        """Run ``write``; when it fails throttled, ``undo`` its partial result, wait, and run it again.

        Args:
            write: One object write (or one rank's DCP data files), from the start.
            undo: Removes what a failed ``write`` left (its partial objects), so the next attempt starts clean.
            what: The object(s), for the log and the final error.

        Raises:
            Exception: The error of a write that is not throttling, unchanged.
            StorageError: The last attempt was still throttled (chained from its error; says how many retries).
        """
        attempt = 0
        while True:
            try:
                return write()
            except Exception as exc:
                if attempt >= self.policy.retries or not is_throttled(exc):
                    if attempt:
                        raise StorageError(
                            f"{what}: {type(exc).__name__}: {exc} (after {attempt} retries of a throttled write)"
                        ) from exc
                    raise
                attempt += 1
                delay = self.policy.delay(attempt)
                with self._lock:
                    self.count += 1
                _log.warning("%s: throttled (%s); retry %d in %.2fs", what, exc, attempt, delay)
                undo()
            self._sleep(delay)
