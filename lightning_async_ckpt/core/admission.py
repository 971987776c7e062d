"""Admission: what happens when a checkpoint is requested while the outstanding limit is reached.

Asynchronous work that storage cannot drain accumulates; it does not become free. The rule is explicit:

* ``wait``: block the caller until a slot frees, and record the delay;
* ``skip``: drop this request and keep the last committed generation;
* ``coalesce``: drop this request but take a fresh cut as soon as the backlog drains;
* ``abort``: raise :class:`~lightning_async_ckpt.errors.AdmissionError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_async_ckpt.errors import ConfigError

__all__ = ["POLICIES", "AdmissionDecision", "AdmissionPolicy", "validate_admission"]

AdmissionPolicy = Literal["wait", "skip", "coalesce", "abort"]
POLICIES: tuple[str, ...] = ("wait", "skip", "coalesce", "abort")


def validate_admission(policy: object, max_outstanding: object) -> None:
    """Raise :class:`ConfigError` naming the parameter if either setting is invalid."""
    if policy not in POLICIES:
        raise ConfigError(f"admission must be one of {', '.join(POLICIES)}; got {policy!r}")
    if isinstance(max_outstanding, bool) or not isinstance(max_outstanding, int) or max_outstanding < 1:
        raise ConfigError(f"max_outstanding must be an int >= 1 (1 is the safe default), got {max_outstanding!r}")


@dataclass(frozen=True)
class AdmissionDecision:
    """What admission decided for one request.

    Attributes:
        requested_step: The step the caller asked to save.
        decision: ``admit``, ``wait`` (admitted after blocking), ``skip``, ``coalesce`` or ``abort``.
        backlog: Saves outstanding when the request arrived.
        committed_step: Newest committed step at that moment (``None`` before the first commit).
        waited_s: Seconds the caller blocked (``wait`` only).
    """

    requested_step: int
    decision: str
    backlog: int
    committed_step: int | None
    waited_s: float = 0.0

    @property
    def admitted(self) -> bool:
        """Whether a save goes ahead."""
        return self.decision in ("admit", "wait")
