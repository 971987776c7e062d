"""The timeline's request panel past :data:`PER_REQUEST_LIMIT` requests: per time bin, the mean seconds spent in each
phase, and each phase's distribution in the legend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MAX_BINS", "PER_REQUEST_LIMIT", "draw_aggregated", "percentile"]

#: Up to this many requests (that ran), the panel has one row per request; above it, it is aggregated.
PER_REQUEST_LIMIT = 20
#: Most time bins of the aggregated panel.
MAX_BINS = 30


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def draw_aggregated(
    ax: Any,
    kept: Sequence[Mapping[str, Any]],
    dropped: Sequence[Mapping[str, Any]],
    t0: float,
    *,
    windows: Callable[[Mapping[str, Any]], dict[str, tuple[float, float]]],
    phases: Sequence[tuple[str, str, str]],
    start_of: Callable[[Mapping[str, Any]], float],
    patch: Callable[..., Any],
) -> dict[str, float]:
    """Draw the aggregated request panel on ``ax``; returns the seconds spent per phase over all requests.

    Args:
        ax: The matplotlib axes.
        kept: The save events of requests that ran (committed, failed, ...).
        dropped: Those admission dropped (skipped or coalesced): counted in the title only.
        t0: The time axis origin.
        windows: A save event's phase windows (``{"cut": (start, end), ...}``), absolute times.
        phases: ``(name, label, colour)`` per phase, the blocking phase (``"cut"``) last.
        start_of: A save event's request time (absolute).
        patch: Makes a legend patch from ``(colour, label)``.
    """
    names = [name for name, _, _ in phases]
    durations: dict[str, list[float]] = {name: [] for name in names}
    starts: list[float] = []
    per_request: list[dict[str, float]] = []
    for s in kept:
        w = windows(s)
        seconds = {}
        for name in names:
            window = w.get(name)
            if not window:
                seconds[name] = 0.0
                continue
            if name == "staging" and "cut" in w:
                # Only the background copy after the blocking window (the part inside it counts as blocking).
                window = (max(window[0], w["cut"][1]), max(window[1], w["cut"][1]))
            seconds[name] = window[1] - window[0]
            durations[name].append(seconds[name])
        starts.append(start_of(s) - t0)
        per_request.append(seconds)
    totals = {name: sum(v) for name, v in durations.items()}
    ax.set_title(
        f"{len(kept)} checkpoint requests, aggregated (mean seconds per request in each time bin; "
        f"{len(dropped)} skipped/coalesced)",
        fontsize=10,
        loc="left",
    )
    ax.set_ylabel("s per request")
    if not kept:
        ax.text(0.5, 0.5, "no save events in this log", transform=ax.transAxes, ha="center", color="#777777")
        return totals
    lo, hi = min(starts), max(starts)
    bins = max(1, min(MAX_BINS, len(kept) // 2))
    width = (hi - lo) / bins if hi > lo else 1.0
    members: list[list[int]] = [[] for _ in range(bins)]
    for i, t in enumerate(starts):
        members[min(bins - 1, int((t - lo) / width))].append(i)
    # The blocking phase at the bottom, then the background phases in pipeline order.
    order = [phases[-1], *phases[:-1]]
    bottoms = [0.0] * bins
    for name, _, colour in order:
        heights = [(sum(per_request[i][name] for i in idx) / len(idx)) if idx else 0.0 for idx in members]
        centers = [lo + (b + 0.5) * width for b in range(bins)]
        ax.bar(centers, heights, width=width * 0.9, bottom=bottoms, color=colour, zorder=3)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    failed = [i for i, s in enumerate(kept) if s.get("outcome") not in ("committed", "pending", None)]
    if failed:
        top = max(bottoms) or 1.0
        ax.plot([starts[i] for i in failed], [top * 1.05] * len(failed), "X", color="black", ms=6, zorder=4)
    handles = []
    for name, label, colour in order:
        v = durations[name]
        stats = f"median {percentile(v, 50):.3g} s, p95 {percentile(v, 95):.3g} s, max {max(v):.3g} s" if v else "none"
        handles.append(patch(colour, f"{label}: {stats}"))
    if failed:
        handles.append(patch("white", f"X: failed attempt ({len(failed)})"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)
    ax.set_ylim(0, (max(bottoms) or 1.0) * 1.9)
    ax.grid(axis="y", alpha=0.3)
    return totals
