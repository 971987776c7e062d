"""The Accelerate adapters of the collective seam (:mod:`lightning_async_ckpt.core.collective`).

:class:`AccelerateCollective` goes through accelerate's ``gather_object``. :class:`BoundedCollective` is the
checkpointer's, over a private gloo group whose exchanges time out: a collective called on some processes only
raises a :class:`~lightning_async_ckpt.errors.CheckpointError` naming the fix within the bound, and once an
exchange timed out every later one raises at once.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any

from lightning_async_ckpt.core.collective import Collective
from lightning_async_ckpt.errors import CheckpointError

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "AccelerateCollective",
    "BoundedCollective",
    "bounded_collective",
    "collective_for",
]


class AccelerateCollective:
    """A :class:`~lightning_async_ckpt.core.collective.Collective` over an ``Accelerator``'s processes."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

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


_log = logging.getLogger("lightning_async_ckpt")
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


class BoundedCollective(AccelerateCollective):
    """A :class:`~lightning_async_ckpt.core.collective.Collective` over a gloo group whose exchanges time out.

    Thread-safety: used on the training thread only (every process calls ``all_gather`` in the same order).

    Args:
        accelerator: The ``Accelerator`` (for the process index and count).
        timeout_s: How long one exchange waits for the other processes.
    """

    def __init__(self, accelerator: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        super().__init__(accelerator)
        self.timeout_s = timeout_s
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._broken: str | None = None

    def release(self) -> None:
        """Destroy the private group (at close); later exchanges raise instead of using it."""
        import torch.distributed as dist

        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):  # best effort: a peer may already be gone
                dist.destroy_process_group(group)
        self._broken = self._broken or "the checkpointer was closed"

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, indexed by process.

        Raises:
            CheckpointError: The other processes did not reach the same call within ``timeout_s`` (or an earlier
                exchange already failed that way).
        """
        import torch.distributed as dist

        if self._broken is not None:
            raise CheckpointError(self._broken)
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:
            self._broken = (
                f"a checkpoint collective on process {self.rank} failed while waiting up to {self.timeout_s:g}s for "
                f"the other {self.world_size - 1} process(es) ({' '.join(str(exc).split())[:200]}): with a "
                "checkpointer attached, accelerator.save_state, accelerator.load_state, save_state(), load_state() "
                "and close() are collectives. Call them on every process, not only under "
                "`if accelerator.is_main_process:` (only the main process writes the shared files anyway); if a "
                "process can legitimately arrive later than that, raise attach(..., collective_timeout_s=...)"
            )
            raise CheckpointError(self._broken) from exc
        return out


def bounded_collective(accelerator: Any, timeout_s: float | None) -> BoundedCollective | None:
    """A bounded collective for ``accelerator``'s processes (collective: every process calls it), or ``None``
    for a single process or where ``torch.distributed`` has no gloo backend (accelerate's exchange is used then).
    """
    import torch.distributed as dist

    if accelerator.num_processes <= 1 or not dist.is_available() or not dist.is_initialized():
        return None
    if not dist.is_gloo_available():
        _log.info("no gloo backend: checkpoint collectives wait as long as the process group's own timeout")
        return None
    return BoundedCollective(accelerator, DEFAULT_COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s)
