"""DCP save-plan caching where the installed torch offers it: plans are not sent again while they do not change.

torch's ``DefaultSavePlanner(enable_plan_caching=True)`` (torch >= 2.7) remembers each rank's local plan and the
coordinator's global plan; when a rank's plan equals the last one it sends an empty, unusable plan to the
coordinator instead, and the coordinator scatters empty plans back, so the planning collective stops growing with
the number of tensors. Two things this library needs on top:

- the cache is keyed per planner instance (torch keys it by class name, process-wide: two checkpointers of
  different models in one process would share it); :func:`caching_planner` gives each checkpointer its own key;
- every save's final plan carries that save's storage data (the attempt's token and prefix, fresh per save from the
  coordinator's claim), never the first save's: the cached plan's items are kept, the new storage data replaces
  the cached one.

:func:`plan_caching_available` feature-detects the parameter; without it the default planner is used unchanged.

Thread-safety: one planner per ``dcp.save``; torch's cache is a class-level dict (torch guards nothing).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["caching_planner", "new_cache_key", "plan_caching_available"]

_keys = itertools.count()


def plan_caching_available() -> bool:
    """Whether the installed torch's ``DefaultSavePlanner`` takes ``enable_plan_caching``."""
    return "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters


def new_cache_key() -> str:
    """A cache key for one checkpointer (the same on every rank when checkpointers are created in step)."""
    return f"lightning_async_ckpt-{next(_keys)}"


class _CachingPlanner(DefaultSavePlanner):
    def __init__(self, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        finished = super().finish_plan(new_plan)
        if new_plan.storage_data is not None and finished.storage_data is not new_plan.storage_data:
            finished = dataclasses.replace(finished, storage_data=new_plan.storage_data)  # this save's attempt
            self.plan = finished
        return finished


def caching_planner(key: str) -> Any:
    """A save planner that caches plans under ``key``, or ``None`` (DCP's default) where torch cannot cache."""
    return _CachingPlanner(key) if plan_caching_available() else None
