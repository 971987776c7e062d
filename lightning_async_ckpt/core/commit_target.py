"""The degenerate commit target (a plain store: its ``committed`` is retention) and the engine's one emergency save.

A target is where a committed generation goes next (:class:`~lightning_async_ckpt.core.interfaces.CommitTarget`).
The engine without tiers hands each commit to a :class:`StoreTarget`; tiers hand it to
:class:`~lightning_async_ckpt.tiers.target.TieredTarget`. :func:`emergency_save` is
:meth:`~lightning_async_ckpt.core.engine.AsyncCheckpointer.emergency_save`, whatever the target.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["StoreTarget", "emergency_save", "time_left"]

_log = logging.getLogger("lightning_async_ckpt")


def time_left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value; ``None``: no bound), never negative."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class StoreTarget:
    """A plain store as the commit target: each commit runs retention (``keep_last``), nothing is handed on.

    Args:
        store: Returns the engine's store at the time of the commit.
        keep_last: Committed generations kept (``None``: keep all: :meth:`committed` does nothing).
        emit: An ``EventLog.emit`` (a ``gc`` event names what retention removed).
    """

    def __init__(self, store: Callable[[], Any], keep_last: int | None, emit: Callable[..., None]) -> None:
        self.store = store
        self.keep_last = keep_last
        self.emit = emit

    def check_save(self) -> None:
        """Every process saves to its own store."""

    def manifest_extra(self) -> dict[str, Any]:
        """Nothing: the store is the only tier."""
        return {}

    def committed(self, step: int, durable: bool | None) -> None:
        """Run retention (a failure is logged: retention never fails a committed save)."""
        if self.keep_last is None:
            return
        try:
            removed = self.store().gc(self.keep_last)
        except Exception:  # noqa: BLE001 - retention never fails a committed save
            _log.warning("retention failed", exc_info=True)
            return
        if removed:
            self.emit("gc", removed=removed)

    def make_durable(self, step: int) -> bool:
        """The store is the only tier: a committed generation is where it lasts."""
        return True

    def drain(self, timeout: float | None) -> bool:
        """Nothing is handed on."""
        return True

    def close(self, timeout: float | None) -> None:
        """Nothing to stop."""

    def report(self, step: int) -> str:
        """Nothing beyond the store."""
        return ""


def emergency_save(engine: Any, step: int, state: Any, grace_s: float | None, kwargs: dict[str, Any]) -> str:
    """:meth:`AsyncCheckpointer.emergency_save`: promote the newest save when it is of ``step`` (a local cut just
    taken), else save ``state`` copied at the cut and durable (``None``: the caller cut already, nothing more);
    drain within ``grace_s``; log and return what is where."""
    deadline = None if grace_s is None else time.monotonic() + grace_s
    engine.preemption.requested.clear()
    newest = engine.newest_save
    cut = newest is not None and newest.step == step and not newest.committed.cancelled()
    if not (cut and newest.decision.admitted and engine.target.make_durable(step)) and state is not None:
        engine.save(step, state, final=True, durable=True, **kwargs)
    saved = engine.in_flight.drain(time_left(deadline))
    handed = engine.target.drain(time_left(deadline))
    where = f"committed step {engine.committed_step} to {engine.store.uri}"
    if not saved:
        where += f" (steps {engine.in_flight_steps()} still in flight after the grace period: not in time)"
    where += engine.target.report(step)
    if not handed:
        where += " (a promotion or a replica was still running after the grace period: not in time)"
    _log.warning("emergency checkpoint at step %d: %s", step, where)
    return where
