"""When the callback takes a cut besides its interval: a coalesced request once the backlog drained, and a retake
after the runtime guard refused a save. Rank 0's answer is broadcast, so all ranks take the extra cut together.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_async_ckpt.core.interfaces import TrainingCheckpointer

__all__ = ["CutSchedule"]


class CutSchedule:
    """The cut bookkeeping shared by every rank: last admitted step, pending coalesce, pending guard verdict.

    Not thread-safe: used on the training thread only.
    """

    def __init__(self) -> None:
        self.last_admitted_step: int | None = None
        self.coalesce_pending = False
        self._coalesce_polled: int | None = None
        self._handle: Any = None
        self._verdict_pending = False
        self._durable = False
        self.retake_durable = False

    def __eq__(self, other: object) -> bool:
        # By value, like ModelCheckpoint's plain attributes: a pickled copy of the callback equals the original.
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def start(self, step: int) -> None:
        """At the start of training (fresh or resumed at ``step``): nothing pending."""
        self.last_admitted_step = step
        self.coalesce_pending = False
        self._verdict_pending = False
        self._handle = None
        self._durable = self.retake_durable = False

    def recorded(self, step: int, decision: str, handle: Any, *, deferred: bool, durable: bool = False) -> None:
        """After a cut's decision (the same on every rank); ``handle`` is rank 0's save handle, else ``None``;
        ``durable``: the save is due on ``dirpath`` (two tiers)."""
        if decision not in ("skip", "coalesce"):
            self.last_admitted_step = step
            self._handle = handle
            # Only a save with deferred state can be refused by the guard.
            self._verdict_pending = deferred
            self._durable = durable
            self.retake_durable = False  # this save was the retake
        self.coalesce_pending = decision == "coalesce" or (self.coalesce_pending and decision == "skip")

    def coalesce_due(self, trainer: pl.Trainer, ck: TrainingCheckpointer | None, step: int) -> bool:
        """Whether a coalesced request should take its fresh cut now (polled at most once per step)."""
        if not self.coalesce_pending or self._coalesce_polled == step:
            return False
        self._coalesce_polled = step
        due = ck is not None and ck.coalesce_due
        return bool(trainer.strategy.broadcast(due, src=0)) if trainer.world_size > 1 else due

    def retake_due(self, trainer: pl.Trainer, ck: TrainingCheckpointer | None) -> bool:
        """Whether the newest admitted save was refused by the guard (torn) and must be retaken now.

        Polled at each batch end until that save ended (committed or refused); one broadcast per poll in DDP.
        """
        if not self._verdict_pending:
            return False
        # The verdict comes when staging lands (seal and fingerprint) or right before the manifest (counters read
        # at the fence): resolved only once the save ended.
        resolved = self._handle is None or self._handle.committed.done()
        retake = bool(resolved and ck is not None and ck.retake_due)
        if trainer.world_size > 1:
            resolved, retake = trainer.strategy.broadcast((resolved, retake), src=0)
        if resolved:
            self._verdict_pending = False
            self._handle = None
        # A refused save due on dirpath is retaken due on dirpath too (two tiers): the next admitted save.
        self.retake_durable = self.retake_durable or (retake and self._durable)
        return retake
