"""The emergency save in Lightning: a signal asks for a checkpoint at the next batch end (``docs/tiers.md``).

At the next batch end after the signal (:func:`preemption_due`, agreed across ranks) the callback takes a cut copied
at the cut (no deferral: no training follows), commits it to the local tier first (or to ``dirpath``, the only
tier), waits for its promotion while ``preemption_grace_s`` allows, logs what was committed where, and stops
training (``trainer.should_stop``). The handler itself is :class:`~lightning_async_ckpt.core.preemption.PreemptionHandler`.
"""

from __future__ import annotations

from typing import Any

from lightning_async_ckpt.core.preemption import PreemptionHandler, check_preemption

__all__ = ["PreemptionHandler", "check_preemption", "preemption_due"]


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
