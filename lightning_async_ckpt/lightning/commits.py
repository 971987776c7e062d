"""The commit hook in Lightning: ``AsyncCheckpointCallback(on_commit=...)`` and any callback's
``on_checkpoint_committed(trainer, pl_module, committed)``.

On rank 0 (the coordinator with sharded strategies) the engine queues a ``Committed`` record at each commit; each
hook that polls delivers them oldest first, after best-k and ``best_model_path`` were updated. A hook that raises is
raised once at the next collective point. ``export=`` is one more listener
(:class:`~lightning_async_ckpt.core.exporter.Exporter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_async_ckpt.core.commit_hooks import METRICS_KEY, Committed, call
from lightning_async_ckpt.core.exporter import Exporter
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.lightning.naming import comparable_path

__all__ = ["HOOK_NAME", "check_on_commit", "cut_metrics", "deliver", "finish_exports", "listen"]

#: The method a Lightning callback defines to be told of each commit.
HOOK_NAME = "on_checkpoint_committed"


def check_on_commit(fn: Any) -> Callable[[Committed], Any] | None:
    """Validate ``on_commit``: ``None`` or a callable taking the :class:`Committed` record."""
    if fn is not None and not callable(fn):
        raise ConfigError(
            f"on_commit must be a callable fn(committed) or None, got {type(fn).__name__}: pass a function that "
            "takes a lightning_async_ckpt.Committed record"
        )
    return fn


def _listeners(cb: Any, trainer: pl.Trainer) -> list[Callable[[Committed], Any]]:
    found: list[Callable[[Committed], Any]] = [cb.on_commit] if cb.on_commit is not None else []
    if cb.exporter is not None:
        found.append(cb.exporter)  # export=: decides on the training thread, writes on its own thread
    module = trainer.lightning_module
    for other in trainer.callbacks:
        method = getattr(other, HOOK_NAME, None)
        if callable(method):
            found.append(partial(method, trainer, module))
    return found


def listen(cb: Any, trainer: pl.Trainer) -> None:
    """At train start: have the callback's engine queue commit records when anyone listens (``export=`` too)."""
    cb.exporter = None
    if cb.export is not None and cb.checkpointer is not None and trainer.is_global_zero:
        cb.exporter = Exporter(cb.export, report=cb.checkpointer.report_error, storage_options=cb.storage_options)
    if cb.checkpointer is not None and _listeners(cb, trainer):
        cb.checkpointer.commit_hooks.manual = True  # delivered here, at the callback's hooks, not by the engine


def cut_metrics(cb: Any, candidates: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``extra`` entry of the scalar metrics at the cut (only when a commit hook listens)."""
    if cb.checkpointer is None or not cb.checkpointer.commit_hooks.manual:
        return {}
    metrics = {}
    for name, value in candidates.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            metrics[name] = float(value.item())
        elif isinstance(value, int | float) and not isinstance(value, bool):
            metrics[name] = float(value)
    return {METRICS_KEY: metrics}


def deliver(cb: Any, trainer: pl.Trainer) -> None:
    """Hand the commits queued since the last call to ``on_commit`` and the callbacks' hooks (rank 0)."""
    engine = cb.checkpointer
    if engine is None or not engine.commit_hooks.manual:
        return
    records = engine.commit_hooks.take()
    if not records or not trainer.is_global_zero:  # each rank's own local tier (sharded): told on rank 0 only
        return
    best = comparable_path(str(cb.best_model_path)) if cb.best_model_path else None
    entries = cb.selection.topk.entries.values()
    best_steps = {e.step for e in entries if e.committed and best and comparable_path(str(e.location)) == best}
    listeners = _listeners(cb, trainer)
    for record in records:  # a promotion's record names the durable copy: the best generation is the same step
        record = replace(record, is_best=record.step in best_steps)
        for fn in listeners:
            call(fn, record, engine.report_error)


def finish_exports(cb: Any) -> None:
    """At the end of fit, after the last commits were delivered: the final export, waited for within
    ``drain_timeout_s`` (it runs on the export thread); a failure is raised like a failed save."""
    if cb.exporter is not None:
        try:
            cb.exporter.finish(cb.options.drain_timeout_s)
        finally:
            cb.exporter = None
