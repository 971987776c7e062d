"""Object-store throttling: which errors mean "slow down", and one exclusive PUT retried without ever overwriting.

:func:`put_exclusive` retries an exclusive create after a jittered doubling backoff, bounded; every retry is again
exclusive. When a retry finds the name taken and the bytes there are exactly this writer's (an earlier attempt
landed but its acknowledgement was lost), the PUT counts as done; otherwise :class:`FileExistsError` is raised.

Thread-safety: stateless; a :class:`PutRetry` is frozen.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_PUT_RETRY", "PutRetry", "is_throttled", "put_exclusive"]

_log = logging.getLogger(__name__)

# How object stores and their clients word throttling (botocore's ClientError codes, HTTP statuses, s3fs's text).
_THROTTLE_WORDS = (
    "slowdown",
    "slow down",
    "throttl",
    "toomanyrequests",
    "too many requests",
    "requestlimitexceeded",
    "reduce your request rate",
    "(503)",
    "(429)",
    " 503 ",
    " 429 ",
    "serviceunavailable",
)


def is_throttled(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the store asking to slow down, or a dropped connection.

    A full disk is never throttling, whatever else the chain says.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    throttled = False
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return False
        if isinstance(cause, ConnectionError | TimeoutError):
            throttled = True
        text = f"{type(cause).__name__} {cause}".lower()
        if any(word in text for word in _THROTTLE_WORDS):
            throttled = True
        cause = cause.__cause__ or cause.__context__
    return throttled


@dataclass(frozen=True, kw_only=True)
class PutRetry:
    """How often a throttled exclusive PUT is retried, and after what delay.

    Attributes:
        retries: Retries after the first attempt (0: none).
        backoff_s: Delay before the first retry; doubles per retry, plus up to half again at random.
    """

    retries: int = 4
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"PutRetry.retries must be an int >= 0, got {self.retries!r}")
        if isinstance(self.backoff_s, bool) or not isinstance(self.backoff_s, int | float) or self.backoff_s < 0:
            raise ValueError(f"PutRetry.backoff_s must be a number >= 0, got {self.backoff_s!r}")

    def delay(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based): as ``RetryPolicy.delay`` (spreads ranks throttled together)."""
        return self.backoff_s * (2 ** (attempt - 1)) * (1.0 + 0.5 * random.random())


#: Four retries after 0.5, 1, 2 and 4 s (each up to half again longer), as ``sharded.write_retry``'s default.
DEFAULT_PUT_RETRY = PutRetry()


def put_exclusive(
    put: Callable[[], None],
    *,
    landed: Callable[[], bool],
    policy: PutRetry | None,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Run the exclusive create ``put``; retry it while the store throttles; return how many retries it took.

    Args:
        put: One exclusive create; raises :class:`FileExistsError` when the name is taken.
        landed: Whether the object now at the name is exactly this writer's (read after a retry found it taken).
        policy: Retries and backoff (``None``: :data:`DEFAULT_PUT_RETRY`).
        what: The object, for the log.
        sleep: What waits out the backoff.

    Raises:
        FileExistsError: The name holds another writer's object (or, on the first attempt, any object).
        Exception: ``put``'s last error when it is not throttling, or still throttled after the retries.
    """
    policy = policy or DEFAULT_PUT_RETRY
    attempt = 0
    while True:
        try:
            put()
            return attempt
        except FileExistsError:
            # Only a retry can find its own earlier PUT (landed, acknowledgement lost); a first attempt lost a race.
            if attempt and landed():
                _log.info("%s: an earlier attempt's PUT landed (its answer was lost); it is this writer's", what)
                return attempt
            raise
        except Exception as exc:
            if attempt >= policy.retries or not is_throttled(exc):
                raise
            attempt += 1
            delay = policy.delay(attempt)
            _log.warning("%s: throttled (%s); retry %d in %.2fs", what, exc, attempt, delay)
        sleep(delay)
