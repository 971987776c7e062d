"""The emergency save in Lightning: a signal asks for a checkpoint at the next batch end (``docs/tiers.md``).

The cut is copied at the cut, committed to the local tier first, promoted while ``preemption_grace_s`` allows, and
training stops. Inside an accumulation window :class:`EmergencyWindow` waits for the window's end within the grace
period, or takes none (never one labelled as a step it is not). The handler is restored at the end of every fit.
"""

from __future__ import annotations

import logging
import signal
import time
from enum import Enum
from typing import Any

from lightning_async_ckpt.core.preemption import PreemptionHandler, check_preemption
from lightning_async_ckpt.lightning.hooks import inside_accumulation_window

__all__ = [
    "Emergency",
    "EmergencyWindow",
    "PreemptionHandler",
    "check_preemption",
    "preemption_due",
    "restore_after_exception",
    "warn_mid_window",
]

_log = logging.getLogger("lightning_async_ckpt")


def preemption_due(handler: PreemptionHandler, trainer: Any) -> bool:
    """Whether the emergency cut is due now (any rank's signal counts); consumes the request.

    Without a configured signal this is false without any collective: a run without ``preemption_signal`` is
    unchanged.
    """
    if handler.signum is None:
        return False
    flag = handler.take()
    if trainer.world_size > 1:
        flag = bool(trainer.strategy.reduce_boolean_decision(flag, all=False))
    return flag


class Emergency(Enum):
    """What a batch end does about the emergency save."""

    NONE = "none"  # no request
    NOW = "now"  # take (or promote) the emergency checkpoint at this batch end
    WAIT = "wait"  # inside an accumulation window: wait for its end
    EXPIRED = "expired"  # the grace period ended inside the window: stop without an emergency checkpoint


class EmergencyWindow:
    """An emergency request carried across the micro-batches of one accumulation window (training thread only).

    Args:
        grace_s: ``preemption_grace_s`` (``None``: no bound).
    """

    def __init__(self, grace_s: float | None) -> None:
        self.grace_s = grace_s
        self.waiting = False
        self.deadline: float | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def point(self, handler: PreemptionHandler, trainer: Any, *, step_cut: bool) -> Emergency:
        """At a batch end: what to do about the request (a collective per call when a signal is configured).

        Args:
            handler: The signal's handler.
            trainer: The trainer.
            step_cut: Whether the current step was cut already (at its own batch end).
        """
        requested = preemption_due(handler, trainer)
        if not (requested or self.waiting):
            return Emergency.NONE
        if step_cut or not inside_accumulation_window(trainer):
            self.waiting = False
            return Emergency.NOW
        if not self.waiting:
            self.waiting = True
            self.deadline = None if self.grace_s is None else time.monotonic() + self.grace_s
            _log.warning(
                "emergency checkpoint requested inside an accumulation window at step %d: waiting for the window's "
                "end (step %d) within preemption_grace_s=%s",
                trainer.global_step,
                trainer.global_step + 1,
                self.grace_s,
            )
        expired = self.deadline is not None and time.monotonic() >= self.deadline
        if trainer.world_size > 1:
            expired = bool(trainer.strategy.broadcast(expired, src=0))
        if not expired:
            return Emergency.WAIT
        self.waiting = False
        return Emergency.EXPIRED

    def left(self) -> float | None:
        """The grace left for the commit and promotion (all of it when nothing was waited for); ends the wait."""
        deadline, self.deadline = self.deadline, None
        if deadline is None:
            return self.grace_s
        return max(0.0, deadline - time.monotonic())


def warn_mid_window(trainer: Any, what: str, kind: str, committed: int | None) -> None:
    """Log that no ``kind`` checkpoint is taken inside an accumulation window, and what to resume from."""
    _log.warning(
        "%s inside an accumulation window at step %d: no %s checkpoint (it would hold part of step %d under step "
        "%d's number); the newest committed checkpoint is step %s",
        what,
        trainer.global_step,
        kind,
        trainer.global_step + 1,
        trainer.global_step,
        committed,
    )


def restore_after_exception(handler: PreemptionHandler, trainer: Any) -> None:
    """In ``on_exception``: restore the handler ``setup`` replaced, also where Lightning restores its own afterwards.

    Lightning's signal connector recorded this handler as one it found and puts it back in its teardown, which runs
    after ``on_exception`` (``teardown`` hooks do not run then): it is told to put back the previous one instead.
    """
    signum, installed = handler.signum, handler.installed_handler()
    handler.remove()
    if signum is None or installed is None:
        return
    originals = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
    if isinstance(originals, dict) and originals.get(signum) == installed:
        previous = handler.previous
        originals[signum] = previous if previous is not None else signal.SIG_DFL
