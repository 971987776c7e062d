"""Object-store requests and time per save and per resume, predicted from request counts measured on S3's API.

The counts and formulas are those of ``docs/backlog-model.md`` (measured by ``benchmarks/bench_requests.py`` and
``tests/storage/test_commit_requests.py``). Time: requests one after another at ``latency_s`` each, except what
the ranks send at once; never faster than the store's rate limits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lightning_async_ckpt.errors import ConfigError

__all__ = [
    "GET_CLASS",
    "PUT_CLASS",
    "RequestPlan",
    "pages",
    "predict_latest_checkpoint",
    "predict_resume",
    "predict_save",
    "predict_sharded_save",
]

LIST_PAGE = 1000  # keys per listing page (S3's maximum)
PUT_CLASS = ("PUT", "POST", "DELETE")  # what S3 limits to ~3,500 per second per prefix
GET_CLASS = ("GET", "HEAD", "LIST")  # ~5,500 per second per prefix


def pages(keys: int) -> int:
    """Listing requests for ``keys`` keys (at least one)."""
    return max(1, -(-keys // LIST_PAGE))


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    """Predicted requests of one operation, by kind, and its time.

    Attributes:
        requests: Requests by kind (``LIST``, ``GET``, ``HEAD``, ``PUT``, ``POST``, ``DELETE``).
        serial: How many of them are sent one after another (the rest go in parallel across ranks).
        time_s: ``max(serial * latency_s, PUT-class / put_rate, GET-class / get_rate, total / rate_limit)``.
        bound: What decided ``time_s``: ``"latency"`` (the serial requests) or the rate limit that did
            (``"put_rate"``, ``"get_rate"``, ``"rate_limit"``).
    """

    requests: dict[str, int]
    serial: int
    time_s: float
    bound: str = "latency"

    @property
    def total(self) -> int:
        """All requests."""
        return sum(self.requests.values())

    def to_dict(self) -> dict[str, object]:
        """The plan as JSON-ready values (``requests`` by kind, ``total``, ``serial``, ``time_s``, ``bound``)."""
        return {
            "requests": dict(self.requests),
            "total": self.total,
            "serial": self.serial,
            "time_s": self.time_s,
            "bound": self.bound,
        }


def _check(**values: float | None) -> None:
    for name, value in values.items():
        if value is None and name in ("rate_limit", "put_rate", "get_rate"):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")


def _plan(
    requests: Counter[str],
    parallel: int,
    latency_s: float,
    rate_limit: float | None,
    put_rate: float | None = None,
    get_rate: float | None = None,
) -> RequestPlan:
    total = sum(requests.values())
    serial = total - parallel
    candidates = [(serial * latency_s, "latency")]
    if rate_limit:
        candidates.append((total / rate_limit, "rate_limit"))
    if put_rate:
        candidates.append((sum(requests[k] for k in PUT_CLASS) / put_rate, "put_rate"))
    if get_rate:
        candidates.append((sum(requests[k] for k in GET_CLASS) / get_rate, "get_rate"))
    time_s, bound = max(candidates, key=lambda c: c[0])
    return RequestPlan(requests={k: v for k, v in requests.items() if v}, serial=serial, time_s=time_s, bound=bound)


def predict_save(
    *,
    objects: int,
    generations: int,
    keep_last: int = 2,
    ranks: int = 1,
    latency_s: float = 0.015,
    rate_limit: float | None = None,
    put_rate: float | None = None,
    get_rate: float | None = None,
) -> RequestPlan:
    """Requests and time of a later save with retention (the formula is in ``docs/backlog-model.md``).

    Args:
        objects: Objects the save writes (one per rank for a sharded save).
        generations: Generations in the folder when retention lists it.
        keep_last: Retention's ``keep_last``.
        ranks: Ranks writing the objects at once (their PUTs overlap; 1: one writer, all serial).
        latency_s: Seconds per request.
        rate_limit: Requests per second the store allows on the prefix (``None``: no limit).
        put_rate: PUT, POST and DELETE requests per second allowed on the prefix (``None``: no limit).
        get_rate: GET, HEAD and LIST requests per second allowed on the prefix (``None``: no limit).

    Raises:
        ConfigError: A negative or non-numeric argument.
    """
    _check(**locals())
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
    return _plan(requests, parallel, latency_s, rate_limit, put_rate, get_rate)


def predict_sharded_save(
    *,
    ranks: int,
    generations: int,
    keep_last: int = 2,
    latency_s: float = 0.015,
    rate_limit: float | None = None,
    put_rate: float | None = None,
    get_rate: float | None = None,
) -> RequestPlan:
    """Requests (all ranks) and time of a later ``ShardedCheckpointer`` save of ``ranks`` ranks with retention.

    One data file per rank (DCP's default), ``.metadata`` and the manifest; the formula is in ``docs/backlog-model.md``.
    Each rank's claim, data file and manifest read run at once with the other ranks'; the coordinator's steps
    (the step claim, the ``.metadata`` publish, the commit and retention) one after another.

    Args:
        ranks: Ranks writing (``N`` >= 1).
        generations: Generations in the folder when retention lists it (this one included).
        keep_last: Retention's ``keep_last``.
        latency_s: Seconds per request.
        rate_limit: Requests per second allowed on the prefix, all kinds (``None``: no limit).
        put_rate: PUT, POST and DELETE requests per second allowed on the prefix.
        get_rate: GET, HEAD and LIST requests per second allowed on the prefix.

    Raises:
        ConfigError: A negative or non-numeric argument.
    """
    _check(**locals())
    n = max(1, ranks)
    during, kept = pages(2 * n + 2), pages(n + 2)  # keys while the ranks write (claims too), then once committed
    requests = Counter(
        PUT=2 * n + 4,
        LIST=3 + 2 * during + pages(generations) + (keep_last + 2) * kept,
        GET=n + keep_last + 4,
        HEAD=3,
        POST=kept,
        DELETE=n + 3,
    )
    parallel = 3 * (n - 1) + max(0, n - 2)  # the other ranks' claim PUT, data PUT, claim DELETE; manifest GETs
    return _plan(requests, parallel, latency_s, rate_limit, put_rate, get_rate)


def predict_resume(
    *,
    objects: int,
    generations: int,
    latency_s: float = 0.015,
    rate_limit: float | None = None,
    put_rate: float | None = None,
    get_rate: float | None = None,
) -> RequestPlan:
    """Requests and time of ``store.latest()`` with the newest generation intact, verified (one rank).

    Args:
        objects: Objects of the newest generation (a sharded one: one per rank, plus DCP's ``.metadata``).
        generations: Generations in the folder.
        latency_s: Seconds per request.
        rate_limit: Requests per second allowed on the prefix, all kinds.
        put_rate: PUT-class requests per second (none are sent; accepted for symmetry).
        get_rate: GET, HEAD and LIST requests per second allowed on the prefix.

    Raises:
        ConfigError: A negative or non-numeric argument.
    """
    _check(**locals())
    requests = Counter(LIST=pages(generations), GET=1 + objects, HEAD=objects)
    return _plan(requests, 0, latency_s, rate_limit, put_rate, get_rate)


def predict_latest_checkpoint(
    *,
    objects: int = 1,
    generations: int,
    latency_s: float = 0.015,
    rate_limit: float | None = None,
    get_rate: float | None = None,
) -> RequestPlan:
    """Requests and time of ``latest_checkpoint(dirpath)`` (one process, no tiers): what :func:`predict_resume` costs.

    The listing of the folder also names its version folders (``v1/``, ...), so no request is added.
    """
    return predict_resume(
        objects=objects, generations=generations, latency_s=latency_s, rate_limit=rate_limit, get_rate=get_rate
    )
