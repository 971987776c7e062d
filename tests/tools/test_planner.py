"""The backlog model: the two worked fluid-queue cases, bytes mode, and rates measured from an event log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_async_ckpt.core.telemetry import EventLog
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.planner import (
    HEADROOM_UTILIZATION,
    plan_from_bytes,
    plan_from_events,
    plan_from_rates,
    read_events,
)


# -- the worked cases (docs/backlog-model.md) -------------------------------------------------------------
def test_drains_when_drain_rate_exceeds_arrival() -> None:
    plan = plan_from_rates(2, 3, 4)
    assert plan.net_rate == -1.0
    assert plan.drain_time == 4.0
    assert plan.sustainable
    assert [plan.backlog_at(t) for t in (0, 1, 2, 3, 4, 5)] == [4.0, 3.0, 2.0, 1.0, 0.0, 0.0]
    assert plan.admission == "wait" and plan.max_outstanding == 1
    assert plan.stall_fraction_if_wait == 0.0


def test_grows_one_unit_per_second_when_arrival_exceeds_drain() -> None:
    plan = plan_from_rates(4, 3, 4, horizon=10)
    assert plan.net_rate == 1.0
    assert plan.drain_time is None
    assert not plan.sustainable
    assert [plan.backlog_at(t) for t in (0, 1, 2, 5, 60)] == [4.0, 5.0, 6.0, 9.0, 64.0]
    assert plan.backlog_at_horizon == 14.0
    assert plan.stall_fraction_if_wait == pytest.approx(0.25)  # 1 - mu/lambda
    assert plan.admission == "coalesce"


def test_to_dict_is_json_with_null_drain_time_when_never() -> None:
    body = json.loads(json.dumps(plan_from_rates(4, 3, 4).to_dict()))
    assert body["drain_time"] is None and body["net_rate"] == 1.0
    body = json.loads(json.dumps(plan_from_rates(2, 3, 4).to_dict()))
    assert body["drain_time"] == 4.0 and body["net_rate"] == -1.0


def test_edge_rates() -> None:
    assert plan_from_rates(2, 3, 0).drain_time == 0.0  # empty and draining
    assert plan_from_rates(3, 3, 0).drain_time == 0.0  # empty and steady
    assert plan_from_rates(3, 3, 5).drain_time is None  # balanced rates never shrink a backlog
    assert plan_from_rates(3, 3, 5).sustainable
    stalled = plan_from_rates(1, 0, 0)
    assert stalled.utilization is None and stalled.stall_fraction_if_wait == 1.0 and stalled.drain_time is None
    idle = plan_from_rates(0, 0, 0)
    assert idle.sustainable and idle.stall_fraction_if_wait == 0.0


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"arrival_rate": -1, "drain_rate": 3}, "--arrival-rate"),
        ({"arrival_rate": 1, "drain_rate": -3}, "--drain-rate"),
        ({"arrival_rate": 1, "drain_rate": 3, "backlog": -4}, "--backlog"),
        ({"arrival_rate": 1, "drain_rate": 3, "horizon": -1}, "--horizon"),
        ({"arrival_rate": math.nan, "drain_rate": 3}, "--arrival-rate"),
        ({"arrival_rate": 1, "drain_rate": math.inf}, "--drain-rate"),
        ({"arrival_rate": True, "drain_rate": 3}, "--arrival-rate"),
        ({"arrival_rate": "2", "drain_rate": 3}, "--arrival-rate"),
    ],
)
def test_bad_rates_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        plan_from_rates(**kwargs)


# -- bytes mode ------------------------------------------------------------------------------------------
def test_bytes_sustainable() -> None:
    plan = plan_from_bytes(600, 60, 20)  # B/W = 30 s <= S = 60 s
    assert plan.units == "bytes" and plan.source == "bytes"
    assert plan.arrival_rate == 10.0 and plan.drain_rate == 20.0
    assert plan.sustainable and plan.utilization == 0.5
    assert plan.min_interval_s == 30.0
    assert plan.recommended_interval_s == pytest.approx(30.0 / HEADROOM_UTILIZATION)
    assert plan.admission == "wait" and plan.stall_fraction_if_wait == 0.0
    assert not any("headroom" in n for n in plan.notes)


def test_bytes_unsustainable_recommends_coalesce_and_prices_wait() -> None:
    plan = plan_from_bytes(600, 20, 20)  # B/W = 30 s > S = 20 s
    assert not plan.sustainable
    assert plan.net_rate == 10.0 and plan.drain_time is None
    assert plan.min_interval_s == 30.0
    assert plan.stall_fraction_if_wait == pytest.approx(1 - 20 / 30)  # 1 - S / (B/W)
    assert plan.admission == "coalesce"
    text = " ".join(plan.notes)
    assert "coalesce" in text and "skip" in text and "wait" in text and "30 s" in text


def test_bytes_at_capacity_is_sustainable_with_a_margin_note() -> None:
    plan = plan_from_bytes(600, 30, 20)  # B/W == S
    assert plan.sustainable and plan.utilization == 1.0
    assert any("headroom" in n for n in plan.notes)


@pytest.mark.parametrize(
    ("args", "flag"),
    [((0, 10, 5), "--bytes"), ((100, 0, 5), "--interval"), ((100, 10, 0), "--bandwidth"), ((100, -1, 5), "--interval")],
)
def test_bytes_bad_input_names_the_flag(args: tuple, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        plan_from_bytes(*args)


# -- event-log mode --------------------------------------------------------------------------------------
def _save(t_request: float, end: float, *, nbytes: int = 100, upload_s: float = 20.0, blocked: float = 0.0) -> dict:
    return {
        "event": "save",
        "t": end,
        "requested_step": int(t_request),
        "outcome": "committed",
        "decision": "admit",
        "t_request": t_request,
        "blocked_s": blocked,
        "bytes": nbytes,
        "upload_s": upload_s,
        "cut_to_committed_s": end - t_request,
        "fence_wait_s": {},
        "phases": {"cut": [t_request, t_request + blocked], "upload": [t_request, t_request + upload_s]},
    }


def test_events_measure_arrival_drain_and_backlog() -> None:
    events = []
    for i, t in enumerate((0.0, 10.0, 20.0, 30.0, 40.0)):
        events.append({"event": "request", "t": t, "step": i, "decision": "admit", "backlog": min(i, 1)})
        events.append({"event": "train_step", "t": t + 1, "step": i})  # unknown to the planner: ignored
        events.append({"event": "uploaded", "t": t + 20, "step": i, "bytes": 100, "upload_s": 20.0})
        events.append(_save(t, t + 20))
    events.append({"event": "fence_wait", "t": 5.0, "fence": "batch_start", "wait_s": 0.0})
    events.append({"event": "from_the_future", "t": 6.0, "anything": [1, 2]})
    plan = plan_from_events(events, horizon=10)
    assert plan.source == "events" and plan.units == "bytes"
    assert plan.interval_s == 10.0
    assert plan.arrival_rate == 10.0  # 100 B every 10 s
    assert plan.drain_rate == 5.0  # 100 B per 20 s of upload
    assert plan.backlog == 100.0  # one save outstanding at the last request
    assert plan.net_rate == 5.0 and plan.drain_time is None
    assert plan.min_interval_s == 20.0
    assert plan.backlog_at_horizon == 150.0
    assert plan.measured["requests"] == 5 and plan.measured["outcomes"] == {"committed": 5}


def test_events_interval_excludes_time_training_was_blocked() -> None:
    # Under admission='wait' each request after the first blocked 5 s; the loop trains 10 s between requests.
    events = []
    for i, t in enumerate((0.0, 15.0, 30.0)):
        events.append({"event": "request", "t": t, "step": i, "decision": "wait", "backlog": 1})
        events.append(_save(t, t + 14, blocked=0.0 if i == 0 else 5.0, upload_s=14.0))
    plan = plan_from_events(events)
    assert plan.measured["wall_interval_s"] == 15.0
    assert plan.interval_s == 10.0
    assert plan.stall_fraction_if_wait == pytest.approx(1 - 10 / 14)


def test_events_fall_back_to_save_events_without_uploaded() -> None:
    events = [{"event": "request", "t": float(t), "step": t, "decision": "admit", "backlog": 0} for t in (0, 4)]
    events += [_save(0.0, 2.0, nbytes=50, upload_s=2.0), _save(4.0, 6.0, nbytes=50, upload_s=2.0)]
    plan = plan_from_events(events)
    assert plan.drain_rate == 25.0 and plan.arrival_rate == 12.5 and plan.drain_time == 0.0


def test_events_too_few_to_measure() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        plan_from_events([{"event": "request", "t": 0.0, "step": 0, "backlog": 0}])
    requests = [{"event": "request", "t": float(t), "step": t, "backlog": 0} for t in (0, 1)]
    with pytest.raises(ConfigError, match="drain rate cannot be measured"):
        plan_from_events(requests)
    with pytest.raises(ConfigError, match="bad 'bytes'"):
        plan_from_events([*requests, {"event": "uploaded", "t": 2.0, "bytes": -5, "upload_s": 1.0}])


def test_read_events_from_an_event_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path))
    for step in (0, 10):
        log.emit("request", step=step, decision="admit", backlog=0, committed_step=None)
        log.emit("uploaded", step=step, bytes=1000, upload_s=0.5)
    log.close()
    events = read_events(str(path))
    assert [e["event"] for e in events] == ["request", "uploaded", "request", "uploaded"]
    assert plan_from_events(events).drain_rate == 2000.0


def test_read_events_tolerates_a_torn_last_line_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "request", "t": 1.0}\n{"event": "req')
    assert len(read_events(str(path))) == 1
    path.write_text('{"event": "request", "t": 1.0}\nnot json\n{"event": "request", "t": 2.0}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_events(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="line 1 is not an object"):
        read_events(str(path))
    path.write_text('{"event": "request"}\n')
    with pytest.raises(ConfigError, match="numeric time"):
        read_events(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        read_events(str(tmp_path / "missing.jsonl"))
