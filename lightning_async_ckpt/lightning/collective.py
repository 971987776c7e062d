"""The Lightning adapter of the one collective seam (:func:`lightning_async_ckpt.core.collective.agree`)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_async_ckpt.core.collective import Collective, agree, default_collective

__all__ = ["agree_on", "collective_for"]


def collective_for(trainer: pl.Trainer) -> Collective | None:
    """The world group of a multi-process Trainer (DDP initializes it), or ``None`` for one process."""
    return default_collective() if trainer.world_size > 1 else None


def agree_on(trainer: pl.Trainer, local_error: BaseException | None, doing: str, payload: Any = None) -> Any:
    """Agree across ranks that ``doing`` succeeded everywhere; return rank 0's ``payload``.

    Raises:
        BaseException: ``local_error`` on the rank that failed, a ``RankFailedError`` on every other rank.
    """
    return agree(collective_for(trainer), local_error, payload, doing=doing)[0]
