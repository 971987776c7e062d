"""The Accelerate adapter of the collective seam (:mod:`lightning_async_ckpt.core.collective`).

Accelerate's ``gather_object`` runs over ``torch.distributed`` underneath; going through it keeps the transport
Accelerate itself uses for every distributed type it supports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.core.collective import Collective

__all__ = ["AccelerateCollective", "collective_for"]


@dataclass(frozen=True)
class AccelerateCollective:
    """A :class:`~lightning_async_ckpt.core.collective.Collective` over an ``Accelerator``'s processes."""

    accelerator: Any

    @property
    def rank(self) -> int:
        """This process's index."""
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.accelerator.num_processes

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, indexed by process (collective: every process must call it)."""
        from accelerate.utils import gather_object

        return gather_object([obj])


def collective_for(accelerator: Any) -> Collective | None:
    """The collective of ``accelerator``'s processes, or ``None`` for a single process."""
    return AccelerateCollective(accelerator) if accelerator.num_processes > 1 else None
