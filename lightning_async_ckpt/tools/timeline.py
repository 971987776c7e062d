"""Timeline plot of an event log: where checkpoint time goes, and what it costs the training loop.

Four panels sharing a time axis: training steps, one row per checkpoint request (binned past
:data:`~lightning_async_ckpt.tools.timeline_requests.PER_REQUEST_LIMIT`), requested versus committed step, and saves
outstanding. matplotlib is optional and imported only when plotting; the Agg canvas is used directly, so the
process-wide pyplot backend never changes.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_async_ckpt.core.telemetry import read_events
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.timeline_requests import PER_REQUEST_LIMIT, draw_aggregated

__all__ = ["plot_timeline"]

# Phase name in SaveRecord.phases -> (legend label, colour). Drawn in this order; the blocking window last, on top.
_PHASES = (
    ("staging", "staging (background copy after the cut)", "#f2a541"),
    ("upload", "upload (serialize + stream)", "#3a7dc9"),
    ("commit", "commit (manifest write)", "#2e9e5b"),
    ("cut", "blocking the training loop", "#d62728"),
)
_DECISION_STYLE = {
    "admit": ("o", "#2e9e5b"),
    "wait": ("v", "#d62728"),
    "skip": ("x", "#7f7f7f"),
    "coalesce": ("s", "#9467bd"),
    "abort": ("X", "#000000"),
}
_DROPPED = ("skipped", "coalesced")
_WAIT_KEYS = ("wait_s", "waited_s", "seconds")


def plot_timeline(events_path: str | os.PathLike[str], out_png: str | os.PathLike[str]) -> Path:
    """Render the timeline of the event log at ``events_path`` into ``out_png``.

    Args:
        events_path: A JSONL event log written by :class:`~lightning_async_ckpt.core.telemetry.EventLog` (local path
            or fsspec URL). Unknown event kinds are ignored.
        out_png: Where to write the PNG (local path; its folder must exist).

    Returns:
        The path written.

    Raises:
        ConfigError: matplotlib is missing (names the extra to install), or the log is malformed or has nothing
            to plot.
    """
    events = read_events(os.fspath(events_path))
    return render_timeline(events, out_png, title=Path(os.fspath(events_path)).name)


def render_timeline(
    events: Sequence[Mapping[str, Any]], out_png: str | os.PathLike[str], *, title: str | None = None
) -> Path:
    """Like :func:`plot_timeline`, from events already in memory (e.g. ``EventLog.events``)."""
    figure_cls, canvas_cls = _matplotlib()
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for ev in events:
        by_kind.setdefault(str(ev.get("event")), []).append(ev)
    saves = sorted(by_kind.get("save", []), key=lambda s: _num(s.get("t_request"), _num(s.get("t"))))
    requests = sorted(by_kind.get("request", []), key=lambda e: e["t"])
    steps = sorted(by_kind.get("train_step", []), key=lambda e: e["t"])
    if not (saves or requests or steps):
        raise ConfigError(
            "the event log has no 'save', 'request' or 'train_step' events; nothing to plot "
            "(is it the log passed to the checkpointer's events=...?)"
        )
    t0 = min(float(ev["t"]) for ev in events)
    for s in saves:
        for window in _phases(s).values():
            t0 = min(t0, window[0])

    fig = figure_cls(figsize=(13, 11), dpi=110, layout="constrained")
    canvas_cls(fig)
    rows = sum(1 for s in saves if s.get("outcome") not in _DROPPED) + 1
    aggregate = rows - 1 > PER_REQUEST_LIMIT
    gantt_height = 3.0 if aggregate else max(2.0, min(6.0, 0.28 * rows + 1.0))
    axes = fig.subplots(4, 1, sharex=True, height_ratios=[1.6, gantt_height, 1.6, 1.2])
    ax_train, ax_gantt, ax_steps, ax_backlog = axes
    totals = _draw_aggregated(ax_gantt, saves, t0) if aggregate else _draw_gantt(ax_gantt, saves, t0)
    _draw_training(ax_train, steps, saves, by_kind.get("fence_wait", []), t0)
    span = max(float(ev["t"]) for ev in events) - t0
    _draw_steps(ax_steps, requests, by_kind.get("committed", []), saves, t0, span)
    _draw_backlog(ax_backlog, requests, saves, t0)
    ax_backlog.set_xlabel("seconds since the first event")

    committed = sum(1 for s in saves if s.get("outcome") == "committed")
    failed = sum(1 for s in saves if s.get("outcome") in ("failed", "torn", "abandoned"))
    dropped = sum(1 for s in saves if s.get("outcome") in _DROPPED)
    blocked = totals["cut"]
    share = f" ({100 * blocked / span:.1f}% of {span:.3g} s)" if span > 0 else ""
    heading = f"Checkpoint timeline{f': {title}' if title else ''}"
    summary = (
        f"{len(requests) or len(saves)} requested, {committed} committed, {failed} failed, {dropped} skipped/coalesced"
        f"  |  training blocked {blocked:.3g} s{share}\nin the background: staging {totals['staging']:.3g} s, "
        f"upload {totals['upload']:.3g} s, commit {totals['commit']:.3g} s"
    )
    fig.suptitle(f"{heading}\n{summary}", fontsize=11)
    out = Path(os.fspath(out_png))
    fig.savefig(out, format="png")
    return out


# -- panels ----------------------------------------------------------------------------------------------
def _draw_training(ax: Any, steps: list, saves: list, fence_waits: list, t0: float) -> None:
    ax.set_title("training progress (red: checkpoint blocked the loop; purple: fence wait)", fontsize=10, loc="left")
    ax.set_ylabel("global step")
    if steps:
        ax.plot([e["t"] - t0 for e in steps], [_num(e.get("step")) for e in steps], color="#333333", lw=1.2)
    else:
        ax.text(0.5, 0.5, "no train_step events in this log", transform=ax.transAxes, ha="center", color="#777777")
    for s in saves:
        cut = _phases(s).get("cut")
        if cut:
            ax.axvspan(cut[0] - t0, cut[1] - t0, color="#d62728", alpha=0.25, lw=0)
    for ev in fence_waits:
        wait = next((_num(ev.get(k)) for k in _WAIT_KEYS if isinstance(ev.get(k), int | float)), 0.0)
        if wait > 0:
            ax.axvspan(ev["t"] - wait - t0, ev["t"] - t0, color="#9467bd", alpha=0.3, lw=0)
    ax.grid(alpha=0.3)


def _draw_aggregated(ax: Any, saves: list, t0: float) -> dict[str, float]:
    return draw_aggregated(
        ax,
        [s for s in saves if s.get("outcome") not in _DROPPED],
        [s for s in saves if s.get("outcome") in _DROPPED],
        t0,
        windows=_phases,
        phases=_PHASES,
        start_of=lambda s: _num(s.get("t_request"), _num(s.get("t"))),
        patch=_patch,
    )


def _draw_gantt(ax: Any, saves: list, t0: float) -> dict[str, float]:
    ax.set_title("each checkpoint request: where its time goes", fontsize=10, loc="left")
    totals = dict.fromkeys(("cut", "staging", "upload", "commit"), 0.0)
    kept = [s for s in saves if s.get("outcome") not in _DROPPED]
    dropped = [s for s in saves if s.get("outcome") in _DROPPED]
    # Dropped requests (skip/coalesce) share one row at the top, so the saves that ran keep readable rows.
    offset = 1 if dropped else 0
    labels = ["skipped / coalesced"] if dropped else []
    few = len(saves) <= 40
    bar = 0.5 if few else 0.85
    failures = 0
    for s in dropped:
        start = _num(s.get("t_request"), _num(s.get("t"))) - t0
        ax.plot([start], [0], marker="x", color="#7f7f7f", ms=7 if few else 4, zorder=4)
    for i, s in enumerate(kept):
        row = i + offset
        phases = _phases(s)
        labels.append(f"step {s.get('requested_step', '?')}")
        for name, _, colour in _PHASES:
            window = phases.get(name)
            if not window:
                continue
            if name == "staging" and "cut" in phases:
                # The staging window opens at the request; the part inside the blocking window is drawn (and
                # counted) as blocking, so the bar shows only the background copy after the cut.
                window = (max(window[0], phases["cut"][1]), max(window[1], phases["cut"][1]))
            totals[name] += window[1] - window[0]
            height = min(1.0, bar + 0.2) if name == "cut" else bar
            ax.barh(row, window[1] - window[0], left=window[0] - t0, height=height, color=colour, zorder=3)
        outcome = s.get("outcome")
        if outcome not in ("committed", "pending", None):
            # The failed attempt ran from the last recorded phase to the `save` event; draw it as an outline.
            start = _num(s.get("t_request"), _num(s.get("t"))) - t0
            last = max((w[1] - t0 for w in phases.values()), default=start)
            end = max(_num(s.get("t"), last + t0) - t0, last)
            ax.barh(row, end - last, left=last, height=bar, fill=False, edgecolor="black", hatch="//", zorder=3)
            ax.plot([end], [row], marker="X", color="black", ms=9 if few else 5, zorder=4)
            ax.annotate(outcome, (end, row), xytext=(8, 0), textcoords="offset points", va="center", fontsize=8)
            failures += 1
    handles = [
        _patch(colour, f"{label}: total {totals[name]:.3g} s") for name, label, colour in (_PHASES[-1], *_PHASES[:-1])
    ]
    if failures:
        handles.append(_patch("white", "failed attempt (until the failure was recorded)", hatch="//"))
    if labels:
        # Rows run top-left to bottom-right over time, so the lower left is where no bar is.
        ax.legend(handles=handles, loc="lower left", fontsize=8, framealpha=0.9)
        every = max(1, len(labels) // 25)
        ticks = sorted({0, *range(offset if every == 1 else every, len(labels), every)})
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)
    else:
        ax.text(0.5, 0.5, "no save events in this log", transform=ax.transAxes, ha="center", color="#777777")
    ax.grid(axis="x", alpha=0.3)
    return totals


def _draw_steps(ax: Any, requests: list, committed_events: list, saves: list, t0: float, t_end: float) -> None:
    ax.set_title("requested vs committed step (shaded: progress not yet recoverable)", fontsize=10, loc="left")
    ax.set_ylabel("step")
    req = [(e["t"] - t0, _num(e.get("step"))) for e in requests]
    if not req:
        req = [(_num(s.get("t_request"), s["t"]) - t0, _num(s.get("requested_step"))) for s in saves]
    com = [(e["t"] - t0, e.get("committed_step")) for e in committed_events]
    if not com:
        com = [(s["t"] - t0, s.get("committed_step")) for s in saves if s.get("outcome") == "committed"]
    com = sorted((t, float(c)) for t, c in com if isinstance(c, int | float))
    req.sort()
    end = max([t_end] + [t for t, _ in req + com])
    if req:
        xs, ys = _step_series(req, end)
        ax.plot(xs, ys, drawstyle="steps-post", color="#d62728", lw=1.5, label="requested (newest cut asked for)")
    if com:
        xs_c, ys_c = _step_series(com, end)
        ax.plot(xs_c, ys_c, drawstyle="steps-post", color="#2e9e5b", lw=1.5, label="committed (recoverable)")
    if req and com:
        grid = sorted({t for t, _ in req + com} | {end})
        r = [_value_at(req, t) for t in grid]
        c = [_value_at(com, t) for t in grid]
        ax.fill_between(
            grid,
            c,
            r,
            where=[a >= b for a, b in zip(r, c, strict=True)],
            step="post",
            color="#d62728",
            alpha=0.12,
            lw=0,
        )
    if req or com:
        ax.legend(loc="upper left", fontsize=8)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


def _draw_backlog(ax: Any, requests: list, saves: list, t0: float) -> None:
    ax.set_title("backlog: saves outstanding (markers: admission decision at each request)", fontsize=10, loc="left")
    ax.set_ylabel("saves")
    # Each admitted save is in flight from the end of its admission wait to the end of its last phase (its `save`
    # event comes a moment later, after the next request may already have been admitted); before that, a
    # request blocked in admission is waiting.
    flight, waiting = [], []
    for s in saves:
        if s.get("outcome") in _DROPPED:
            continue
        t_req = _num(s.get("t_request"), s["t"])
        start = t_req + _num(s.get("admission_wait_s"))
        ends = [w[1] for w in _phases(s).values()]
        end = max([*ends, start]) if s.get("outcome") == "committed" and ends else max(float(s["t"]), start)
        flight += [(start - t0, +1), (end - t0, -1)]
        if start > t_req:
            waiting += [(t_req - t0, +1), (start - t0, -1)]
    top = 1.0
    if flight:
        xs, in_flight = _sweep(flight)
        ax.fill_between(xs, 0, in_flight, step="post", color="#999999", alpha=0.5, lw=0, label="in flight")
        top = max(in_flight)
        if waiting:
            xs_all, both = _sweep(flight + waiting)
            ax.plot(
                xs_all,
                both,
                drawstyle="steps-post",
                color="#d62728",
                lw=1.2,
                label="in flight + waiting in admission (training blocked)",
            )
            top = max(both)
    seen = set()
    size = 6 if len(requests) <= 60 else 3
    for e in requests:
        decision = str(e.get("decision"))
        marker, colour = _DECISION_STYLE.get(decision, ("d", "#17becf"))
        ax.plot(
            [e["t"] - t0],
            [_num(e.get("backlog"))],
            marker=marker,
            color=colour,
            ls="none",
            ms=size,
            label=None if decision in seen else f"request: {decision}",
        )
        seen.add(decision)
        top = max(top, _num(e.get("backlog")))
    if flight or requests:
        ax.legend(loc="upper left", fontsize=8, ncol=3)
    ax.set_ylim(-0.1, top * 1.6 + 0.2)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


# -- helpers ---------------------------------------------------------------------------------------------
def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch  # noqa: F401 - fail here, not halfway through a plot
    except ImportError as exc:
        raise ConfigError(
            f"the timeline plot needs matplotlib, which is not installed: pip install 'lightning_async_ckpt[plot]' "
            f"({exc})"
        ) from exc
    return Figure, FigureCanvasAgg


def _patch(colour: str, label: str, hatch: str | None = None) -> Any:
    from matplotlib.patches import Patch

    if hatch:
        return Patch(facecolor=colour, edgecolor="black", hatch=hatch, label=label)
    return Patch(color=colour, label=label)


def _phases(save: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    out = {}
    raw = save.get("phases")
    if not isinstance(raw, Mapping):
        return out
    for name, window in raw.items():
        if (
            isinstance(window, list | tuple)
            and len(window) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in window)
            and window[1] >= window[0]
        ):
            out[str(name)] = (float(window[0]), float(window[1]))
    return out


def _num(value: Any, default: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def _step_series(points: list[tuple[float, float]], end: float) -> tuple[list[float], list[float]]:
    points = sorted(points)
    xs = [t for t, _ in points] + [end]
    ys = [v for _, v in points] + [points[-1][1]]
    return xs, ys


def _sweep(changes: list[tuple[float, int]]) -> tuple[list[float], list[int]]:
    level, xs, ys = 0, [0.0], [0]
    for t, delta in sorted(changes):
        level = max(0, level + delta)
        xs.append(t)
        ys.append(level)
    return xs, ys


def _value_at(points: list[tuple[float, float]], t: float) -> float:
    """Value of a step series (points sorted by time) at ``t``; NaN before its first point."""
    i = bisect.bisect_right(points, t, key=lambda p: p[0])
    return points[i - 1][1] if i else float("nan")
