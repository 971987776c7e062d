"""The one collective seam: every cross-rank agreement goes through ``agree``, which alone turns "one rank failed" into
"every rank raises", so no call site can forget a collective and hang the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from lightning_async_ckpt.errors import CheckpointError

__all__ = ["Collective", "RankFailedError", "TorchCollective", "agree", "default_collective"]


class Collective(Protocol):
    """Exchange one picklable object per rank. Every rank must call ``all_gather`` in the same order."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, indexed by rank."""
        ...


@dataclass(frozen=True)
class TorchCollective:
    """A :class:`Collective` over an initialized ``torch.distributed`` process group (gloo or NCCL)."""

    group: Any = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def default_collective() -> Collective | None:
    """The world group when ``torch.distributed`` runs with more than one rank, else ``None`` (single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCollective()
    return None


class RankFailedError(CheckpointError):
    """Raised on the ranks that did not fail themselves when another rank failed at the same agreement point."""


def agree(
    collective: Collective | None,
    local_error: BaseException | None,
    payload: Any = None,
    *,
    doing: str,
) -> list[Any]:
    """Agree across ranks on whether ``doing`` succeeded everywhere and exchange one payload per rank.

    Args:
        collective: the ranks to agree with; ``None`` means a single process.
        local_error: this rank's error for ``doing``, or ``None``.
        payload: any picklable value to share (e.g. a decision or a per-rank commit report).
        doing: what was being done, for the message raised on the other ranks.

    Returns:
        Every rank's payload, indexed by rank (a one-element list without a collective).

    Raises:
        BaseException: ``local_error`` itself on a rank that failed; a :class:`RankFailedError` naming the failing
            ranks and their messages on every other rank.
    """
    if collective is None:
        if local_error is not None:
            raise local_error
        return [payload]
    summary = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    gathered = collective.all_gather((summary, payload))
    if local_error is not None:
        raise local_error
    failures = [(rank, msg) for rank, (msg, _) in enumerate(gathered) if msg is not None]
    if failures:
        named = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures)
        raise RankFailedError(f"{doing} failed on another rank ({named}); see that rank's log")
    return [p for _, p in gathered]
