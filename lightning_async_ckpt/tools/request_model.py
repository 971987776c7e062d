"""Object-store requests and time per save and per resume, predicted from request counts measured on S3's API.

The counts are those of ``benchmarks/bench_requests.py`` and ``tests/storage/test_commit_requests.py`` (a moto S3
server, every request counted): a later save with ``keep_last=K`` of ``N`` objects (one per rank of a sharded save)
into a folder of ``G`` generations, and ``store.latest()`` (what resume runs) of a generation of ``N`` objects.
Listings cost one request per 1,000 keys (a *page*). The model:

* save: PUT ``N + 3`` (the objects, the step claim, the attempt claim, the manifest); LIST ``4 + 2 pages(N) +
  pages(G) + K pages(N)`` (the commit lists the generation before and after its manifest, retention lists the
  folder and each kept generation); GET ``4 + K``; HEAD 1; POST ``pages(N)`` (one batch delete of the removed
  generation); DELETE 3. Nothing grows with ``G`` beyond the folder's listing pages;
* resume: LIST ``pages(G)``, GET ``1 + N`` (the manifest, each object's bytes), HEAD ``N`` (each object's size).

Time: requests one after another at ``latency_s`` each, except a sharded save's object PUTs, which the ranks send
at once; never faster than ``rate_limit`` requests per second (S3: ~3,500 PUT/s and ~5,500 GET/s per prefix).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lightning_async_ckpt.errors import ConfigError

__all__ = ["RequestPlan", "pages", "predict_resume", "predict_save"]

LIST_PAGE = 1000  # keys per listing page (S3's maximum)


def pages(keys: int) -> int:
    """Listing requests for ``keys`` keys (at least one)."""
    return max(1, -(-keys // LIST_PAGE))


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    """Predicted requests of one operation, by kind, and its time.

    Attributes:
        requests: Requests by kind (``LIST``, ``GET``, ``HEAD``, ``PUT``, ``POST``, ``DELETE``).
        serial: How many of them are sent one after another (the rest go in parallel across ranks).
        time_s: ``max(serial * latency_s, total / rate_limit)``.
    """

    requests: dict[str, int]
    serial: int
    time_s: float

    @property
    def total(self) -> int:
        """All requests."""
        return sum(self.requests.values())


def _check(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")


def _plan(requests: Counter[str], parallel: int, latency_s: float, rate_limit: float | None) -> RequestPlan:
    total = sum(requests.values())
    serial = total - parallel
    time_s = serial * latency_s
    if rate_limit:
        time_s = max(time_s, total / rate_limit)
    return RequestPlan(requests={k: v for k, v in requests.items() if v}, serial=serial, time_s=time_s)


def predict_save(
    *,
    objects: int,
    generations: int,
    keep_last: int = 2,
    ranks: int = 1,
    latency_s: float = 0.015,
    rate_limit: float | None = None,
) -> RequestPlan:
    """Requests and time of a later save with retention (see the module docstring for the formula).

    Args:
        objects: Objects the save writes (one per rank for a sharded save).
        generations: Generations in the folder when retention lists it.
        keep_last: Retention's ``keep_last``.
        ranks: Ranks writing the objects at once (their PUTs overlap; 1: one writer, all serial).
        latency_s: Seconds per request.
        rate_limit: Requests per second the store allows on the prefix (``None``: no limit).

    Raises:
        ConfigError: A negative or non-numeric argument.
    """
    _check(objects=objects, generations=generations, keep_last=keep_last, ranks=ranks, latency_s=latency_s)
    n = pages(objects)
    requests = Counter(
        PUT=objects + 3,
        LIST=4 + 2 * n + pages(generations) + keep_last * n,
        GET=4 + keep_last,
        HEAD=1,
        POST=n,
        DELETE=3,
    )
    parallel = objects - -(-objects // max(1, ranks))  # all but one rank's share of the object PUTs overlap
    return _plan(requests, parallel, latency_s, rate_limit)


def predict_resume(
    *, objects: int, generations: int, latency_s: float = 0.015, rate_limit: float | None = None
) -> RequestPlan:
    """Requests and time of ``store.latest()`` with the newest generation intact, verified (one rank)."""
    _check(objects=objects, generations=generations, latency_s=latency_s)
    requests = Counter(LIST=pages(generations), GET=1 + objects, HEAD=objects)
    return _plan(requests, 0, latency_s, rate_limit)
