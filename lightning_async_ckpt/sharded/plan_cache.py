"""DCP save-plan caching where the installed torch offers it (``enable_plan_caching``, torch >= 2.7).

:func:`caching_planner` keys the cache per checkpointer (torch keys it by class name, process-wide) and gives every
save's plan that save's storage data; without the parameter the default planner is used unchanged.

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
