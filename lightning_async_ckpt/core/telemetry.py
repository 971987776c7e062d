"""Telemetry: one record per save, and a JSONL event log that the command line plots and plans from."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import IO, Any

import fsspec

from lightning_async_ckpt.errors import ConfigError

__all__ = ["EventLog", "Outcome", "SaveRecord", "StepClock", "read_events"]

_log = logging.getLogger("lightning_async_ckpt")


class Outcome(StrEnum):
    """How one save request ended (the ``outcome`` of its record and ``save`` event; a ``str``)."""

    PENDING = "pending"
    """Still in flight."""
    COMMITTED = "committed"
    """The manifest is durable: recoverable progress."""
    FAILED = "failed"
    """Capture, staging or upload failed; the error is raised on the training thread."""
    TORN = "torn"
    """The runtime guard saw a deferred tensor change before staging; refused, retake due."""
    SKIPPED = "skipped"
    """Admission dropped the request (``skip``)."""
    COALESCED = "coalesced"
    """Admission dropped the request and a fresh cut follows once drained (``coalesce``)."""
    ABORTED = "aborted"
    """Admission refused the request with ``AdmissionError`` (``abort``)."""
    ABANDONED = "abandoned"
    """``close`` (or the interpreter-exit drain) gave up on it; no manifest was written."""


@dataclass
class SaveRecord:
    """Measurements of one save request, also emitted as the ``save`` event.

    Attributes:
        requested_step: The step the caller asked to save.
        committed_step: Newest committed step once this save ended (``None`` before the first commit).
        decision: The admission decision (an ``AdmissionDecision`` value).
        outcome: How it ended: an :class:`Outcome`.
        backlog: Saves outstanding when the request arrived.
        blocked_s: Seconds the caller was blocked at the cut (admission wait, capture and copy-at-cut).
        admission_wait_s: Part of ``blocked_s`` spent waiting for admission.
        fence_wait_s: Seconds waited at each fence.
        staging_s: Background staging seconds.
        upload_s: Serialization and upload seconds.
        commit_s: Manifest write seconds.
        cut_to_committed_s: From the request to the manifest being durable.
        bytes: Bytes stored.
        sync_bytes: Bytes copied at the cut.
        deferred_bytes: Bytes staged in the background.
        throughput_bps: ``bytes / upload_s``.
        peak_retained_bytes: Peak host bytes held by staging buffers so far.
        error: The failure, if any.
        t_request: Wall-clock time of the request (``time.time()``).
        step_slowdown_s: What the training steps felt: the extra time of every step that overlapped this save (from
            the step of its cut until the first batch start after it ended), against the median step with no save
            in flight (:class:`StepClock`); ``None`` until such a step was measured, or without a batch-start
            fence. Unlike ``blocked_s`` it includes the cores the background copy, checksum and write took.
        slowed_steps: How many steps ``step_slowdown_s`` sums over.
        phases: Wall-clock start/end of each phase, for the timeline.
    """

    requested_step: int
    committed_step: int | None = None
    decision: str = "admit"
    outcome: Outcome = Outcome.PENDING
    backlog: int = 0
    blocked_s: float = 0.0
    admission_wait_s: float = 0.0
    fence_wait_s: dict[str, float] = field(default_factory=dict)
    staging_s: float = 0.0
    upload_s: float = 0.0
    commit_s: float = 0.0
    cut_to_committed_s: float | None = None
    bytes: int = 0
    sync_bytes: int = 0
    deferred_bytes: int = 0
    throughput_bps: float | None = None
    peak_retained_bytes: int = 0
    error: str | None = None
    t_request: float = field(default_factory=time.time)
    step_slowdown_s: float | None = None
    slowed_steps: int = 0
    phases: dict[str, list[float]] = field(default_factory=dict)

    def mark(self, phase: str, start: float, end: float | None = None) -> None:
        """Record a phase's wall-clock window."""
        self.phases[phase] = [start, end if end is not None else time.time()]

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly copy."""
        return asdict(self)


class StepClock:
    """Step periods seen at the batch-start fence, and the slowdown each save caused (what a step feels).

    ``ckpt/blocked_s`` counts only the time spent inside the library's calls; on a CPU machine the background
    copy, checksum and write take cores from training too, so the steps around a save get slower by more than that.
    The clock measures it from outside: each :meth:`tick` (one per batch start) closes a period; a period with no
    save in flight is a quiet sample (the newest ``window`` of them give the median); a period that overlapped
    saves adds ``period - median`` to each of their :attr:`SaveRecord.step_slowdown_s`.

    Training thread only (not thread-safe).

    Args:
        window: How many recent quiet periods the median uses.
    """

    def __init__(self, window: int = 64) -> None:
        self._quiet: deque[float] = deque(maxlen=window)
        self._last: float | None = None
        self._warm_up = True  # the first period: allocations and lazy set-up, no baseline
        self._open: list[SaveRecord] = []

    @property
    def quiet_median_s(self) -> float | None:
        """Median step period with no save in flight (``None`` before the first quiet step)."""
        return statistics.median(self._quiet) if self._quiet else None

    def tick(self, now: float, in_flight: list[SaveRecord], *, started: bool = False, background: bool = False) -> None:
        """A batch starts at ``now`` (``time.perf_counter()``) with the records of the saves still in flight.

        ``started``: a save was requested during the period that ends now (it counts as in flight even when it already
        ended). ``background``: other library work ran during the period (the pool filling ahead of the first cut). Such
        periods, and the first one (it allocates), are no quiet samples.
        """
        involved = {id(r): r for r in [*self._open, *in_flight]}
        if self._last is not None:
            period = now - self._last
            if involved or started:
                base = self.quiet_median_s
                for record in involved.values():
                    record.slowed_steps += 1
                    if base is not None:
                        record.step_slowdown_s = (record.step_slowdown_s or 0.0) + period - base
            elif not background and not self._warm_up:
                self._quiet.append(period)
            self._warm_up = False
        self._last = now
        self._open = list(in_flight)


class EventLog:
    """Append-only JSONL events (``{"event": ..., "t": ..., ...}``) to a local path or fsspec URL.

    Thread-safe. Each line is flushed as written, so a crashed run leaves a readable log.

    Args:
        path: Where to append; ``None`` keeps events in memory only (``events``).
        keep: How many events to keep in memory.
    """

    def __init__(self, path: str | None = None, *, keep: int = 10_000) -> None:
        self.path = path
        self.keep = keep
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            self._file = fsspec.open(path, "a", encoding="utf-8").open()

    def emit(self, event: str, **fields: Any) -> None:
        """Record one event."""
        record = {"event": event, "t": time.time(), **fields}
        with self._lock:
            self.events.append(record)
            if len(self.events) > self.keep:
                del self.events[: len(self.events) - self.keep]
            if self._file is not None:
                try:
                    self._file.write(json.dumps(record, default=str) + "\n")
                    self._file.flush()
                except Exception:  # noqa: BLE001 - telemetry must never break a save (e.g. ENOSPC on the log's disk)
                    _log.warning(
                        "event log %s failed; events are kept in memory only from now on", self.path, exc_info=True
                    )
                    with contextlib.suppress(Exception):
                        self._file.close()
                    self._file = None

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str) -> list[dict[str, Any]]:
    """Read a JSONL event log (local path or fsspec URL) into a list of dicts.

    A torn last line (a run killed mid-write) is dropped; any other line that is not a JSON object with an
    ``event`` name and a numeric ``t`` is an error.

    Raises:
        ConfigError: The file is missing, unreadable or malformed (names the line).
    """
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise ConfigError(f"event log {path!r} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"could not read event log {path!r}: {exc}") from exc
    lines = text.split("\n")
    events = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            if number == len(lines):  # no trailing newline: the writer died mid-line
                break
            raise ConfigError(f"event log {path!r} line {number} is not valid JSON ({exc})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise ConfigError(f"event log {path!r} line {number} is not an object with an 'event' name")
        t = record.get("t")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ConfigError(f"event log {path!r} line {number} has no numeric time 't'")
        events.append(record)
    return events
