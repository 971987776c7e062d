"""What the background copiers of the tiers share: events, quiet retention, object collectives, the promoters' queue.

:class:`PromotionQueue` is the part :class:`~lightning_async_ckpt.tiers.promote.Promoter` (one stream) and
:class:`~lightning_async_ckpt.tiers.promote_dcp.DcpPromoter` (every rank together) have in common: at most one
promotion in flight and the newest due step pending (a newer request replaces a pending one, counted in
``skipped``), :meth:`~PromotionQueue.drain`, the pending step dropped at close, and how a failure is reported.
The copy itself, and the thread that runs it, are the subclass's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["NewestWins", "PromotionQueue", "emit", "from_first", "gather", "retain_quietly"]

_log = logging.getLogger("lightning_async_ckpt")


def emit(on_event: Callable[..., None] | None, what: str, name: str, /, **fields: Any) -> None:
    """Call ``on_event(name, **fields)`` when set; its failure is logged (DEBUG), never raised (telemetry)."""
    if on_event is not None:
        try:
            on_event(name, **fields)
        except Exception:  # noqa: BLE001 - telemetry never fails a promotion or a replica
            _log.debug("%s event %s not recorded", what, name, exc_info=True)


def gather(group: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` over ``group``, by rank (collective; ``[obj]`` without a group)."""
    if group is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def from_first(group: Any, obj: Any) -> Any:
    """Rank 0 of ``group``'s ``obj``, on every rank (collective; ``obj`` itself without a group)."""
    if group is None:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def retain_quietly(store: CheckpointStore, keep_last: int | None, **options: Any) -> None:
    """``store.retain(keep_last, verify=False, **options)`` unless ``keep_last`` is ``None``; a failure is logged,
    never raised (retention never fails a commit, a promotion or a replica)."""
    if keep_last is None:
        return
    try:
        store.retain(keep_last, verify=False, **options)
    except Exception:  # noqa: BLE001 - see the docstring
        _log.warning("retention of %s failed", store.uri, exc_info=True)


class NewestWins:
    """One item in flight at most and the newest pending (guarded by ``_cond``): the queue of a promoter's or a
    replicator's worker thread, which runs :meth:`_serve`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: Any = None
        self._in_flight: Any = None
        self._closing = False

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; return whether that happened within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._working(), timeout)

    def _working(self) -> bool:
        return self._pending is not None or self._in_flight is not None

    def _serve(self, work: Callable[[Any], None]) -> None:
        # The worker thread: ``work`` on each item taken from pending, until the queue closes with nothing pending.
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return
                item, self._pending = self._pending, None
                self._in_flight = item
            try:
                work(item)
            finally:
                with self._cond:
                    self._in_flight = None
                    self._cond.notify_all()


class PromotionQueue(NewestWins):
    """The bounded queue of promotions from ``source`` to ``target``, their reporting, and ``source``'s retention
    (module docstring; the arguments are :class:`~lightning_async_ckpt.tiers.promote.Promoter`'s).

    Thread-safety: every method may be called from any thread; the state is guarded by ``_cond``.
    """

    def __init__(
        self,
        source: CheckpointStore,
        target: CheckpointStore,
        *,
        keep_last: int | None = None,
        source_keep_last: int | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        on_event: Callable[..., None] | None = None,
        on_commit: Callable[[Manifest], None] | None = None,
    ) -> None:
        super().__init__()
        self.source, self.target = source, target
        self.keep_last, self.source_keep_last = keep_last, source_keep_last
        self.on_error = on_error
        self.on_event = on_event
        self.on_commit = on_commit
        self.promoted_step: int | None = None
        self.skipped = 0
        self.failed: list[int] = []
        self._due: set[int] = set()  # asked to be promoted, not yet covered by a promotion (or a round)
        self._newest_due: int | None = None
        self._retaining = False  # a pass over source runs (one at a time: two would remove the same generation)
        self._retain_again = False

    def committed(self, step: int, *, promote: bool) -> None:
        """Generation ``step`` was committed on ``source``; ``promote`` asks for its promotion."""
        raise NotImplementedError

    def protected(self) -> frozenset[int]:
        """Steps ``source``'s retention must keep."""
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> bool:
        """Finish the promotions asked for (within ``timeout``) and stop; whether they ended in time."""
        raise NotImplementedError

    def _mark_due(self, step: int) -> None:
        self._due.add(step)
        self._newest_due = max(step, self._newest_due or step)

    def _queue(self, step: int) -> None:
        # Under _cond: ``step`` becomes the pending promotion unless a newer one is; an older pending one is skipped.
        if self._pending is not None and self._pending < step:
            self.skipped += 1
            _log.info("promotion of step %d skipped: step %d is newer", self._pending, step)
            self._event("promotion_skipped", step=self._pending)
        if self._pending is None or self._pending < step:
            self._pending = step
        self._cond.notify_all()

    def _stop_queue(self, timeout: float | None) -> tuple[bool, int | None]:
        """Drain within ``timeout``, then close the queue (a pending promotion is dropped, logged); (whether the
        drain finished, the step still in flight)."""
        finished = self.drain(timeout)
        with self._cond:
            self._closing = True
            dropped, self._pending = self._pending, None
            running = self._in_flight
            self._cond.notify_all()
        if dropped is not None:
            _log.warning("promotion of step %d to %s dropped at close (the drain timed out)", dropped, self.target.uri)
        return finished, running

    def _retain_source(self) -> None:
        # Called after each local commit and each promotion: one pass at a time; a pass asked for while one runs is
        # run by that one once it ends, so the caller never waits.
        if self.source_keep_last is None:
            return
        with self._cond:
            if self._retaining:
                self._retain_again = True
                return
            self._retaining = True
        while True:
            retain_quietly(self.source, self.source_keep_last, protect=self.protected())
            with self._cond:
                if not self._retain_again:
                    self._retaining = False
                    return
                self._retain_again = False

    def _fail(self, step: int | None, exc: BaseException, message: str, error: str) -> None:
        if step is not None:
            self.failed.append(step)
        _log.warning("%s", message)
        self._event("promotion_failed", step=step, error=error)
        if self.on_error is not None:
            self.on_error(exc)

    def _event(self, name: str, **fields: Any) -> None:
        emit(self.on_event, "promotion", name, **fields)
