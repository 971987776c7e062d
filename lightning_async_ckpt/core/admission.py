"""Admission: what happens when a checkpoint is requested while the outstanding limit is reached.

``wait`` blocks until a slot frees, ``skip`` drops the request, ``coalesce`` drops it but takes a fresh cut once the
backlog drains, ``abort`` raises :class:`~lightning_async_ckpt.errors.AdmissionError`. :class:`Admission` is the
one object that decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from lightning_async_ckpt.errors import AdmissionError, ConfigError

__all__ = ["POLICIES", "Admission", "AdmissionDecision", "AdmissionPolicy", "AdmissionResult", "validate_admission"]

AdmissionPolicy = Literal["wait", "skip", "coalesce", "abort"]
POLICIES: tuple[str, ...] = ("wait", "skip", "coalesce", "abort")


class AdmissionDecision(StrEnum):
    """What admission decided for one request (a ``str``: compares equal to its value, e.g. ``"wait"``)."""

    ADMIT = "admit"
    """Under the limit: the save goes ahead at once."""
    WAIT = "wait"
    """The caller blocked until a slot freed; then the save went ahead."""
    SKIP = "skip"
    """Dropped; the last committed generation stays the newest."""
    COALESCE = "coalesce"
    """Dropped; a fresh cut is due once the backlog drains (:attr:`Admission.coalesce_due`)."""
    ABORT = "abort"
    """Refused with :class:`~lightning_async_ckpt.errors.AdmissionError`."""


def validate_admission(policy: object, max_outstanding: object) -> None:
    """Raise :class:`ConfigError` naming the parameter if either setting is invalid."""
    if policy not in POLICIES:
        raise ConfigError(f"admission must be one of {', '.join(POLICIES)}; got {policy!r}")
    if isinstance(max_outstanding, bool) or not isinstance(max_outstanding, int) or max_outstanding < 1:
        raise ConfigError(f"max_outstanding must be an int >= 1 (1 is the safe default), got {max_outstanding!r}")


@dataclass(frozen=True)
class AdmissionResult:
    """What admission decided for one request.

    Attributes:
        requested_step: The step the caller asked to save.
        decision: The decision.
        backlog: Saves outstanding when the request arrived.
        committed_step: Newest committed step at that moment (``None`` before the first commit).
        waited_s: Seconds the caller blocked (``wait`` only).
    """

    requested_step: int
    decision: AdmissionDecision
    backlog: int
    committed_step: int | None
    waited_s: float = 0.0

    @property
    def admitted(self) -> bool:
        """Whether a save goes ahead."""
        return self.decision in (AdmissionDecision.ADMIT, AdmissionDecision.WAIT)


class Admission:
    """Decides each request against the outstanding limit; remembers a pending coalesce and the skip count.

    Called on the training thread only.

    Args:
        max_outstanding: Saves that may be in flight at once.
        policy: The default rule when the limit is reached.
    """

    def __init__(self, *, max_outstanding: int, policy: str) -> None:
        validate_admission(policy, max_outstanding)
        self.max_outstanding = max_outstanding
        self.policy = policy
        self.pending_coalesce: int | None = None
        self.skipped = 0

    def decide(
        self,
        step: int,
        *,
        policy: str | None,
        backlog: Callable[[], int],
        wait_one: Callable[[], None],
        committed_step: Callable[[], int | None],
    ) -> AdmissionResult:
        """Decide for a request at ``step``.

        Args:
            step: The requested step.
            policy: This request's rule, or ``None`` for the configured one.
            backlog: Returns the saves outstanding now.
            wait_one: Blocks until the oldest outstanding save ended (``wait`` only).
            committed_step: Returns the newest committed step now.

        Returns:
            The decision; for ``abort`` the caller raises :meth:`refusal` (after recording the request).
        """
        rule = policy if policy is not None else self.policy
        if rule not in POLICIES:
            raise ConfigError(f"admission must be one of {', '.join(POLICIES)} or None, got {policy!r}")
        now = backlog()
        if now < self.max_outstanding:
            self.pending_coalesce = None
            return AdmissionResult(step, AdmissionDecision.ADMIT, now, committed_step())
        if rule == AdmissionDecision.ABORT:
            return AdmissionResult(step, AdmissionDecision.ABORT, now, committed_step())
        if rule == AdmissionDecision.SKIP:
            self.skipped += 1
            return AdmissionResult(step, AdmissionDecision.SKIP, now, committed_step())
        if rule == AdmissionDecision.COALESCE:
            self.skipped += 1
            self.pending_coalesce = step
            return AdmissionResult(step, AdmissionDecision.COALESCE, now, committed_step())
        t0 = time.perf_counter()
        while backlog() >= self.max_outstanding:
            wait_one()
        return AdmissionResult(step, AdmissionDecision.WAIT, now, committed_step(), time.perf_counter() - t0)

    def refusal(self, result: AdmissionResult) -> AdmissionError:
        """The error an ``abort`` decision raises, naming the step, the backlog and the alternatives."""
        return AdmissionError(
            f"checkpoint for step {result.requested_step} requested while {result.backlog} save(s) are outstanding "
            f"(max_outstanding={self.max_outstanding}, admission='abort'); storage is not keeping up: "
            "checkpoint less often, raise max_outstanding, or choose admission='wait', 'skip' or 'coalesce'"
        )

    def coalesce_due(self, backlog: int) -> bool:
        """True when a coalesced request is waiting and the backlog has drained: take a fresh cut now."""
        return self.pending_coalesce is not None and backlog < self.max_outstanding
