"""The backlog model: checkpoint bytes arrive at rate lambda and drain at rate mu (a fluid queue).

A schedule is sustainable iff ``B / W <= S``. The model is rates only and certifies no schedule or memory budget;
see ``docs/backlog-model.md``. Everything here is a pure function of its inputs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.fmt import fmt_bytes

__all__ = [
    "HEADROOM_UTILIZATION",
    "BacklogPlan",
    "backlog_at",
    "drain_time",
    "plan_from_bytes",
    "plan_from_rates",
]

# Above this utilization (lambda / mu) a schedule is sustainable on paper but a modest bandwidth dip (shared
# storage, multipart retries, a noisy neighbour) tips it into growth; the planner suggests headroom.
HEADROOM_UTILIZATION = 0.8


@dataclass(frozen=True, kw_only=True)
class BacklogPlan:
    """What the backlog model says about one configuration.

    Attributes:
        source: ``"rates"``, ``"bytes"`` or ``"events"``: which inputs the plan came from.
        units: ``"units"`` (rates mode, any unit) or ``"bytes"``.
        arrival_rate: lambda, units per second.
        drain_rate: mu, units per second.
        backlog: q0, units outstanding at ``t = 0``.
        net_rate: ``lambda - mu``; negative drains, positive grows.
        drain_time: Seconds until the backlog is empty; ``None`` when it never empties.
        utilization: ``lambda / mu``; ``None`` when nothing drains (``mu = 0``).
        sustainable: ``lambda <= mu``: on average each checkpoint drains before the next arrives.
        bytes_per_checkpoint: B, when known.
        interval_s: S, seconds between checkpoint requests, when known.
        min_interval_s: ``B / W``: the smallest sustainable interval, when B is known.
        recommended_interval_s: An interval with headroom (utilization <= ``HEADROOM_UTILIZATION``), when B is
            known.
        stall_fraction_if_wait: Fraction of wall time training would block under ``admission="wait"``:
            ``max(0, 1 - mu / lambda)``, i.e. ``1 - S / (B / W)``.
        admission: Recommended admission rule (``wait``, ``coalesce``, ...).
        max_outstanding: Recommended outstanding-save limit.
        horizon_s: The horizon asked for, if any.
        backlog_at_horizon: Backlog at ``horizon_s``, if a horizon was given.
        notes: Human-readable reasons and caveats, one per line.
        measured: Event-log mode only: what was measured (counts, spans, throughputs).
    """

    source: str
    units: str
    arrival_rate: float
    drain_rate: float
    backlog: float
    net_rate: float
    drain_time: float | None
    utilization: float | None
    sustainable: bool
    bytes_per_checkpoint: float | None = None
    interval_s: float | None = None
    min_interval_s: float | None = None
    recommended_interval_s: float | None = None
    stall_fraction_if_wait: float = 0.0
    admission: str = "wait"
    max_outstanding: int = 1
    horizon_s: float | None = None
    backlog_at_horizon: float | None = None
    notes: tuple[str, ...] = ()
    measured: dict[str, Any] | None = field(default=None)

    def backlog_at(self, t: float) -> float:
        """Backlog at ``t`` seconds: ``max(0, q0 + (lambda - mu) * t)``."""
        return backlog_at(self.backlog, self.net_rate, t)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly copy (``drain_time`` is ``None`` when the backlog never empties)."""
        body = asdict(self)
        body["notes"] = list(self.notes)
        return body


def backlog_at(q0: float, net_rate: float, t: float) -> float:
    """Fluid-queue backlog at time ``t`` from ``q0`` with net rate ``lambda - mu`` (never below zero)."""
    return max(0.0, q0 + net_rate * t)


def drain_time(q0: float, arrival_rate: float, drain_rate: float) -> float | None:
    """Seconds until backlog ``q0`` empties, or ``None`` if it never does.

    Empty already (``q0 == 0``) and not growing gives ``0.0``; ``mu > lambda`` gives ``q0 / (mu - lambda)``.
    """
    if q0 <= 0 and arrival_rate <= drain_rate:
        return 0.0
    if drain_rate > arrival_rate:
        return q0 / (drain_rate - arrival_rate)
    return None


def plan_from_rates(
    arrival_rate: float,
    drain_rate: float,
    backlog: float = 0.0,
    *,
    horizon: float | None = None,
    bytes_per_checkpoint: float | None = None,
    interval_s: float | None = None,
    source: str = "rates",
    measured: dict[str, Any] | None = None,
) -> BacklogPlan:
    """Evaluate the model for arrival rate ``lambda``, drain rate ``mu`` and backlog ``q0``.

    Args:
        arrival_rate: lambda, units per second (``--arrival-rate``), >= 0.
        drain_rate: mu, units per second (``--drain-rate``), >= 0.
        backlog: q0, units outstanding now (``--backlog``), >= 0.
        horizon: Also report the backlog at this many seconds (``--horizon``), >= 0.
        bytes_per_checkpoint: B when the units are bytes (enables interval advice).
        interval_s: S, seconds between checkpoints, when known.
        source: Recorded in the plan.
        measured: Recorded in the plan (event-log mode).

    Raises:
        ConfigError: A negative, infinite or non-numeric input; the message names the flag.
    """
    lam = _number(arrival_rate, "--arrival-rate", "units/s")
    mu = _number(drain_rate, "--drain-rate", "units/s")
    q0 = _number(backlog, "--backlog", "units")
    if horizon is not None:
        horizon = _number(horizon, "--horizon", "seconds")
    net = lam - mu
    sustainable = lam <= mu
    utilization = lam / mu if mu > 0 else None
    if lam == 0:
        stall = 0.0
    elif mu == 0:
        stall = 1.0
    else:
        stall = max(0.0, 1.0 - mu / lam)
    min_interval = recommended = None
    if bytes_per_checkpoint is not None and mu > 0:
        min_interval = bytes_per_checkpoint / mu
        recommended = min_interval / HEADROOM_UTILIZATION
    notes = _advice(lam, mu, q0, utilization, stall, interval_s, min_interval, recommended, bytes_per_checkpoint)
    admission = "wait" if sustainable else "coalesce"
    return BacklogPlan(
        source=source,
        units="bytes" if bytes_per_checkpoint is not None else "units",
        arrival_rate=lam,
        drain_rate=mu,
        backlog=q0,
        net_rate=net,
        drain_time=drain_time(q0, lam, mu),
        utilization=utilization,
        sustainable=sustainable,
        bytes_per_checkpoint=bytes_per_checkpoint,
        interval_s=interval_s,
        min_interval_s=min_interval,
        recommended_interval_s=recommended,
        stall_fraction_if_wait=stall,
        admission=admission,
        max_outstanding=1,
        horizon_s=horizon,
        backlog_at_horizon=None if horizon is None else backlog_at(q0, net, horizon),
        notes=tuple(notes),
        measured=measured,
    )


def plan_from_bytes(
    bytes_per_checkpoint: float,
    interval_s: float,
    bandwidth: float,
    backlog: float = 0.0,
    *,
    horizon: float | None = None,
) -> BacklogPlan:
    """Evaluate the model for B bytes per checkpoint every S seconds over W bytes/s: ``lambda = B/S``, ``mu = W``.

    Args:
        bytes_per_checkpoint: B (``--bytes``), > 0.
        interval_s: S (``--interval``), seconds between checkpoint requests, > 0.
        bandwidth: W (``--bandwidth``), persist throughput in bytes per second, > 0.
        backlog: Bytes outstanding now (``--backlog``), >= 0.
        horizon: Also report the backlog at this many seconds (``--horizon``).

    Raises:
        ConfigError: A non-positive size, interval or bandwidth; the message names the flag.
    """
    size = _number(bytes_per_checkpoint, "--bytes", "bytes", positive=True)
    interval = _number(interval_s, "--interval", "seconds", positive=True)
    width = _number(bandwidth, "--bandwidth", "bytes/s", positive=True)
    return plan_from_rates(
        size / interval,
        width,
        backlog,
        horizon=horizon,
        bytes_per_checkpoint=size,
        interval_s=interval,
        source="bytes",
    )


# -- helpers ---------------------------------------------------------------------------------------------
def _advice(
    lam: float,
    mu: float,
    q0: float,
    utilization: float | None,
    stall: float,
    interval_s: float | None,
    min_interval: float | None,
    recommended: float | None,
    size: float | None,
) -> list[str]:
    notes = []
    rate = f"{fmt_bytes(lam - mu)}/s" if size is not None else f"{lam - mu:.4g} units/s"
    if lam <= mu:
        notes.append(
            "sustainable: on average each save drains before the next request, so admission='wait' with "
            "max_outstanding=1 blocks only when one save runs long; more outstanding saves add retained memory, "
            "not throughput"
        )
        if q0 > 0 and mu > lam:
            notes.append(f"the current backlog drains in {q0 / (mu - lam):.4g} s")
        elif q0 > 0:
            notes.append("arrival equals drain: the current backlog never shrinks")
        if utilization is not None and utilization > HEADROOM_UTILIZATION:
            hint = f"; an interval of {recommended:.4g} s restores headroom" if recommended is not None else ""
            notes.append(
                f"utilization {utilization:.2f} is above {HEADROOM_UTILIZATION}: little headroom; a bandwidth dip "
                f"(shared storage, retries) of {100 * (1 - utilization):.0f}% makes the backlog grow{hint}"
            )
        return notes
    if mu == 0:
        notes.append("nothing drains (drain rate 0): no checkpoint can commit; check the storage path")
    notes.append(f"unsustainable: the backlog grows {rate}; asynchronous work accumulates, it does not become free")
    if min_interval is not None and interval_s is not None:
        every = math.ceil(min_interval / interval_s)
        notes.append(
            f"admission='coalesce' keeps training at full speed and commits a fresh cut about every "
            f"{min_interval:.4g} s (storage time per checkpoint); admission='skip' also keeps speed and commits "
            f"every {every} request(s) (~{every * interval_s:.4g} s)"
        )
        notes.append(f"or raise the interval to at least {min_interval:.4g} s ({recommended:.4g} s with headroom)")
    else:
        notes.append(
            "admission='coalesce' or 'skip' keeps training at full speed and commits less often than requested"
        )
    notes.append(
        f"admission='wait' keeps every requested cut but blocks training about {100 * stall:.0f}% of the time "
        "(1 - mu/lambda); raising max_outstanding only grows the backlog and retained memory"
    )
    return notes


def _number(value: Any, flag: str, unit: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{flag} must be a finite number of {unit}, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{flag} must be > 0 {unit}, got {value!r}")
    if value < 0:
        raise ConfigError(f"{flag} must be >= 0 {unit}, got {value!r}; rates and backlogs cannot be negative")
    return float(value)
