"""Event-derived planning: measure the backlog model's rates from a checkpointer's event log.

The backlog and request models' names are re-exported here, so ``lightning_async_ckpt.tools.planner`` stays the one
import for both; see ``docs/backlog-model.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from lightning_async_ckpt.core.telemetry import read_events
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.backlog import (
    HEADROOM_UTILIZATION,
    BacklogPlan,
    backlog_at,
    drain_time,
    plan_from_bytes,
    plan_from_rates,
)
from lightning_async_ckpt.tools.fmt import fmt_bytes
from lightning_async_ckpt.tools.request_model import RequestPlan, predict_resume, predict_save

__all__ = [
    "HEADROOM_UTILIZATION",
    "BacklogPlan",
    "RequestPlan",
    "backlog_at",
    "drain_time",
    "plan_from_bytes",
    "plan_from_events",
    "plan_from_rates",
    "predict_resume",
    "predict_save",
    "read_events",
]

# Decisions of a request that was admitted (a save went ahead); the others dropped the request.
_ADMITTED = ("admit", "wait")


def plan_from_events(events: Iterable[Mapping[str, Any]], *, horizon: float | None = None) -> BacklogPlan:
    """Measure lambda, mu and the backlog from an event log (see :class:`~lightning_async_ckpt.core.telemetry.EventLog`).

    * arrival: mean bytes per checkpoint over the mean interval between ``request`` events, where the interval
      counts training time only (the span minus the time checkpoints blocked training, which under
      ``admission="wait"`` throttles the loop to the drain rate);
    * drain: total bytes over total ``upload_s`` of the ``uploaded`` events (``save`` events when there are none);
    * backlog: saves outstanding at the last request, times the mean bytes per checkpoint.

    Unknown events (``train_step``, ``fence_wait``, newer ones) are ignored.

    Raises:
        ConfigError: Fewer than two requests, no measured upload, or malformed fields.
    """
    requests: list[Mapping[str, Any]] = []
    uploads: list[tuple[float, float]] = []
    saves: list[Mapping[str, Any]] = []
    for ev in events:
        kind = ev.get("event")
        if kind == "request":
            requests.append(ev)
        elif kind == "uploaded":
            uploads.append((_field(ev, "bytes"), _field(ev, "upload_s")))
        elif kind == "save":
            saves.append(ev)
    if len(requests) < 2:
        raise ConfigError(
            f"the event log has {len(requests)} 'request' event(s); measuring an arrival rate needs at least 2 "
            "(log a longer run, or use --arrival-rate/--drain-rate or --bytes/--interval/--bandwidth)"
        )
    if not uploads:
        uploads = [(_field(s, "bytes"), _field(s, "upload_s")) for s in saves if s.get("bytes")]
    uploads = [(b, s) for b, s in uploads if b > 0 and s > 0]
    if not uploads:
        raise ConfigError(
            "the event log has no 'uploaded' (or 'save') event with bytes and upload_s > 0; nothing was persisted, "
            "so the drain rate cannot be measured"
        )
    requests.sort(key=lambda ev: _field(ev, "t"))
    t_first, t_last = _field(requests[0], "t"), _field(requests[-1], "t")
    span = t_last - t_first
    if span <= 0:
        raise ConfigError("every 'request' event in the log has the same time; cannot measure an arrival rate")
    # Time training spent blocked by checkpoints (admission wait, copy at the cut, fence waits) stretched the
    # span: under admission='wait' the loop is throttled to the drain rate, so the wall-clock request rate would
    # understate the offered load. The model's interval is training time between requests.
    blocked_in_span = sum(
        _field(s, "blocked_s", default=0.0) + sum(_fence_waits(s))
        for s in saves
        if t_first < _field(s, "t_request", default=0.0) <= t_last
    )
    train_span = span - blocked_in_span if span - blocked_in_span > 0 else span
    mean_interval = train_span / (len(requests) - 1)
    mean_bytes = sum(b for b, _ in uploads) / len(uploads)
    drain = sum(b for b, _ in uploads) / sum(s for _, s in uploads)
    backlog_saves = _field(requests[-1], "backlog", default=0.0)
    outcomes: dict[str, int] = {}
    for s in saves:
        outcomes[str(s.get("outcome"))] = outcomes.get(str(s.get("outcome")), 0) + 1
    end_to_end = [
        (_field(s, "bytes"), _field(s, "cut_to_committed_s"))
        for s in saves
        if s.get("outcome") == "committed" and s.get("bytes") and s.get("cut_to_committed_s")
    ]
    blocked = sum(_field(s, "blocked_s", default=0.0) for s in saves)
    measured: dict[str, Any] = {
        "requests": len(requests),
        "admitted": sum(1 for r in requests if r.get("decision") in _ADMITTED),
        "outcomes": outcomes,
        "span_s": span,
        "blocked_in_span_s": blocked_in_span,
        "wall_interval_s": span / (len(requests) - 1),
        "mean_interval_s": mean_interval,
        "mean_bytes": mean_bytes,
        "upload_throughput_bps": drain,
        "end_to_end_bps": (sum(b for b, _ in end_to_end) / sum(s for _, s in end_to_end)) if end_to_end else None,
        "backlog_saves": backlog_saves,
        "blocked_s_total": blocked,
        "blocked_fraction": blocked / span,
    }
    plan = plan_from_rates(
        mean_bytes / mean_interval,
        drain,
        backlog_saves * mean_bytes,
        horizon=horizon,
        bytes_per_checkpoint=mean_bytes,
        interval_s=mean_interval,
        source="events",
        measured=measured,
    )
    e2e = measured["end_to_end_bps"]
    if e2e is not None and e2e < 0.8 * drain:
        extra = (
            f"measured end-to-end rate (request to commit) is {fmt_bytes(e2e)}/s, below the upload rate "
            f"{fmt_bytes(drain)}/s: staging and the manifest commit also hold the outstanding slot; with "
            "max_outstanding=1 plan with the lower rate (--bandwidth)"
        )
        plan = replace(plan, notes=(*plan.notes, extra))
    return plan


# -- helpers ---------------------------------------------------------------------------------------------
def _field(event: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = event.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"event {event.get('event')!r} at t={event.get('t')} has a bad {key!r}: {value!r}")
    return float(value)


def _fence_waits(save: Mapping[str, Any]) -> list[float]:
    waits = save.get("fence_wait_s")
    if not isinstance(waits, Mapping):
        return []
    return [float(v) for v in waits.values() if isinstance(v, int | float) and not isinstance(v, bool) and v > 0]
