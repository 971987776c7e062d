"""``AsyncCheckpointCallback`` under sharded strategies: every rank writes its shards in torch DCP's format.

Under ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor parallelism, ``save_distributed_checkpoint=True``)
and ``FSDPStrategy(state_dict_type="sharded")`` the callback hands each cut to a :class:`ShardedCallbackCheckpointer`
on every rank instead of the single-writer :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer` on rank 0.
It writes exactly what the strategy's own ``save_checkpoint`` writes, into one store generation:

- the model's and optimizers' sharded state in DCP's format (``__<rank>_0.distcp`` per rank, ``.metadata``), under
  the strategy's keys (``state_dict`` for ``ModelParallelStrategy``, ``model`` for ``FSDPStrategy``, and
  ``optimizer_<i>``);
- everything else of Lightning's checkpoint (loops, epoch, step, callbacks, schedulers, hyper-parameters) as
  ``meta.pt`` (``torch.save``), written by rank 0, which is what Lightning's sharded load reads besides DCP's files;
- ``manifest.json`` last, by the coordinator, listing every rank's objects (the two-phase commit of
  :mod:`lightning_async_ckpt.sharded`).

So a committed generation folder is a checkpoint the strategy loads: ``trainer.fit(ckpt_path=folder)``;
:func:`~lightning_async_ckpt.lightning.resume.latest_checkpoint` returns the folder for such generations.

Collectives: the callback's agreements at the cut (decision, capture errors) run on the training thread on the
default group, as under DDP; DCP's plan exchange, result gather and commit broadcast run on the
:class:`~lightning_async_ckpt.sharded.ShardedCheckpointer`'s own gloo group, on its background thread, so they
never interleave with training collectives.

The cut: each rank captures its local shards with the engine's proof, categories, fences, guard and pooled buffers
(:mod:`lightning_async_ckpt.sharded.capture`): parameters and optimizer state are staged behind the callback's
fences (``on_train_batch_start``, ``on_before_optimizer_step``) when proven, everything else is copied at the cut.
Any override of a Lightning hook that may write state between the cut and a fence (the table in
:mod:`lightning_async_ckpt.lightning.hooks`) turns deferral off for that save: everything is copied at the cut.
``meta.pt`` is serialized at the cut. One save is in flight at a time (``admission="wait"``,
``max_outstanding=1``).
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.engine import CheckpointOptions
from lightning_async_ckpt.core.telemetry import EventLog
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.lightning.collective import agree_on
from lightning_async_ckpt.lightning.hooks import override_failures
from lightning_async_ckpt.lightning.sliced import (
    DDP_LAYOUTS,
    guard_strategy_dcp_loads,
    install_dcp_loader,
    is_ddp,
    replicated_only,
)
from lightning_async_ckpt.sharded import DCP_FORMAT, ShardedCheckpointer, ShardedSaveError
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "LIGHTNING_META_NAME",
    "ShardedCallbackCheckpointer",
    "is_lightning_dcp_generation",
    "model_key_for",
    "setup_sharded",
    "to_strategy_layout",
]

_log = logging.getLogger("lightning_async_ckpt")

#: Lightning's metadata file beside DCP's files (``lightning.fabric.utilities.load._METADATA_FILENAME``).
LIGHTNING_META_NAME = "meta.pt"


def model_key_for(strategy: Any) -> str | None:
    """The key under which ``strategy`` saves the model in a DCP checkpoint, or ``None`` if it writes no DCP folder.

    ``ModelParallelStrategy`` with ``save_distributed_checkpoint=True`` saves ``state_dict``;
    ``FSDPStrategy`` with ``state_dict_type="sharded"`` saves ``model``. Detected by class name and the
    strategy's own setting, so a subclass behaves like its base.
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        return "state_dict"
    if "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", None) == "sharded":
        return "model"
    return None


def to_strategy_layout(checkpoint: dict[str, Any], model_key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Lightning's checkpoint like the strategy's ``save_checkpoint``: (DCP state, ``meta.pt`` content).

    Args:
        checkpoint: ``trainer._checkpoint_connector.dump_checkpoint()``'s dict (consumed: keys are popped).
        model_key: :func:`model_key_for` of the strategy.

    Returns:
        ``({model_key: model state, "optimizer_<i>": optimizer state, ...}, the rest of the checkpoint)``.
    """
    state = {model_key: checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": osd for i, osd in enumerate(checkpoint.pop("optimizer_states", []))})
    return state, checkpoint


def is_lightning_dcp_generation(manifest: Manifest | None) -> bool:
    """Whether a committed generation is a DCP folder Lightning's sharded strategies load (it has ``meta.pt``)."""
    return (
        manifest is not None
        and manifest.extra.get("format") == DCP_FORMAT
        and LIGHTNING_META_NAME in {o.name for o in manifest.objects}
    )


@dataclass(frozen=True)
class _Decision:
    decision: str = "admit"


@dataclass(frozen=True)
class ShardedRecord:
    """What the callback logs of the newest committed sharded save (this rank's view)."""

    step: int
    blocked_s: float
    staging_s: float
    cut_to_committed_s: float
    bytes: int


@dataclass(eq=False)
class ShardedCallbackHandle:
    """The callback's view of one sharded save: ``decision`` (always admitted) and the ``committed`` future."""

    step: int
    committed: Future
    blocked_s: float
    deferred_bytes: int = 0
    decision: _Decision = _Decision()


class ShardedCallbackCheckpointer:
    """Per-rank stand-in for ``AsyncCheckpointer`` inside ``AsyncCheckpointCallback`` under sharded strategies.

    It offers the part of ``AsyncCheckpointer``'s interface the callback uses (``save``, ``wait``,
    ``take_pending_error``, ``drain_quietly``, ``close``, progress properties) and drives a
    :class:`~lightning_async_ckpt.sharded.ShardedCheckpointer` on this rank.

    Args:
        store: The store (the same root and run id on every rank).
        model_key: :func:`model_key_for` of the strategy.
        rank: This process's global rank (rank 0 writes ``meta.pt``).
        options: The callback's ``CheckpointOptions`` (``on_error``, ``keep_last``, ``guard``,
            ``host_memory_budget``, ``event_log``).
        deferral_blocked: Called with the LightningModule at each cut; returns the reasons deferral is unsafe
            (overridden hooks that may write state before a fence), empty when it may defer.
        replicated: DDP (``ddp_layout="sliced"``): the state is replicated; ranks other than 0 leave the module's
            buffers out (see :mod:`~lightning_async_ckpt.lightning.sliced`) and DCP deduplicates the rest.
        timeout_s: Bound on every collective of a save (the checkpoint group's timeout).
    """

    writes_dcp = True  # every rank writes DCP files (core.interfaces.TrainingCheckpointer)

    def __init__(
        self,
        store: CheckpointStore,
        *,
        model_key: str,
        rank: int,
        options: CheckpointOptions,
        deferral_blocked: Callable[[Any], list[str]] = lambda module: [],
        replicated: bool = False,
        timeout_s: float = 300.0,
    ) -> None:
        self.store = store
        self.model_key = model_key
        self.rank = rank
        self.on_error = options.on_error
        self.inner = ShardedCheckpointer(
            store,
            keep_last=options.keep_last,
            timeout_s=timeout_s,
            guard=options.guard,
            host_memory_budget=options.host_memory_budget,
        )
        self.pool = self.inner.pool
        self.events = EventLog(options.event_log if rank == 0 else None)
        self.deferral_blocked = deferral_blocked
        self.replicated = replicated
        self.committed_step: int | None = None
        self.last_committed: ShardedRecord | None = None
        self.deferred_bytes = 0  # staged behind the fences, over every save of this checkpointer
        self.coalesce_due = False
        self._torn = False  # the newest save was refused by the guard on some rank: retake it
        self._handle: ShardedCallbackHandle | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    @property
    def retake_due(self) -> bool:
        """Whether the newest save was refused by the runtime guard on some rank and must be retaken (as in the
        single-writer engine); cleared by the next save."""
        handle = self._handle
        if handle is not None and handle.committed.done() and getattr(handle.committed.exception(), "torn", False):
            self._torn = True
        return self._torn

    @property
    def outstanding(self) -> int:
        """1 while a save is in flight, else 0."""
        return int(self._handle is not None and not self._handle.committed.done())

    def declare_fences(self, fences: Any) -> None:
        """The fences the callback passes (``on_train_batch_start``, ``on_before_optimizer_step``)."""
        self.inner.declare_fences(fences)

    def wait(self, fence: Fence, *, raise_errors: bool = True) -> None:
        """At ``fence``: wait until the deferred shards fenced there are staged.

        A staging failure also fails the save on every rank (DCP's plan step), so with ``raise_errors=False``
        (distributed) it is raised later, at a collective point, on every rank.
        """
        try:
            self.inner.wait(fence)
        except Exception:
            if raise_errors:
                raise
            _log.debug("staging failed at fence %s; the save fails on every rank", fence, exc_info=True)

    def preallocate(self, state: Any, **kwargs: Any) -> None:
        """No-op: the host buffers are allocated at the first cut and reused."""

    def save(
        self,
        step: int,
        checkpoint: dict[str, Any],
        *,
        modules: list[Any],
        optimizers: list[Any],
        defer: bool = True,
        **kwargs: Any,
    ) -> ShardedCallbackHandle:
        """Capture this rank's shards at the cut and write generation ``step`` (every rank, at the same step).

        Args:
            step: The global step.
            checkpoint: Lightning's checkpoint dict (``dump_checkpoint``); consumed.
            modules: The LightningModule (in a list), whose parameters and buffers the plan classifies.
            optimizers: The trainer's optimizers.
            defer: ``False`` copies every shard at the cut.
            **kwargs: The single-writer engine's other options (``proof``, ``cut``, ``admission``): not used.

        Raises:
            ShardedSaveError: The previous save failed (every rank raises it).
        """
        start = time.perf_counter()
        state, meta = to_strategy_layout(checkpoint, self.model_key)
        if self.replicated and self.rank != 0 and modules:
            state[self.model_key] = replicated_only(state[self.model_key], modules[0])
        objects = None
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(meta, buffer)
            objects = {LIGHTNING_META_NAME: buffer.getvalue()}
        blocked_by = self.deferral_blocked(modules[0]) if defer and modules else []
        if blocked_by:
            _log.debug("step %s copied at the cut: %s", step, "; ".join(blocked_by))
        if self._handle is not None:
            # The previous save ends first (one in flight); a guard refusal is not an error to raise here.
            self.drain_quietly(None)
            error = self.take_pending_error()
            if error is not None:
                raise error
        self._torn = False
        inner = self.inner.save(
            step, state, modules=modules, optimizers=optimizers, defer=defer and not blocked_by, objects=objects
        )
        blocked = time.perf_counter() - start
        handle = ShardedCallbackHandle(
            step=step, committed=inner.committed, blocked_s=blocked, deferred_bytes=inner.deferred_bytes
        )
        self.deferred_bytes += inner.deferred_bytes
        inner.committed.add_done_callback(lambda f, s=step, t=start, b=blocked: self._ended(f, s, t, b))
        self._handle = handle
        return handle

    def _ended(self, future: Future, step: int, start: float, blocked: float) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        manifest = future.result()
        self.committed_step = step if self.committed_step is None else max(self.committed_step, step)
        self.last_committed = ShardedRecord(
            step=step,
            blocked_s=blocked,
            staging_s=blocked,
            cut_to_committed_s=time.perf_counter() - start,
            bytes=manifest.total_bytes if manifest is not None else 0,
        )
        self.events.emit("committed", step=step)

    def take_pending_error(self) -> BaseException | None:
        """The failure of an ended save, once (``None`` while it runs, or when ``on_error="warn"`` logged it)."""
        handle = self._handle
        if handle is None or not handle.committed.done():
            return None
        self._handle = None
        try:
            self.inner.drain(0)
        except ShardedSaveError as exc:
            if exc.torn:
                # Refused, not failed: the torn categories are copied at the cut from now on; the callback retakes.
                self._torn = True
                _log.warning("%s; it is retaken at the next batch end", exc)
                return None
            if self.on_error == "warn":
                _log.warning("sharded checkpoint save failed: %s", exc)
                return None
            return exc
        return None

    def drain_quietly(self, timeout: float | None) -> bool:
        """Wait for the save in flight without raising; whether it ended."""
        handle = self._handle
        if handle is None:
            return True
        try:
            handle.committed.exception(timeout)
        except TimeoutError:
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Drain and close; raises the last save's failure (unless ``on_error="warn"``)."""
        self._closed = True
        try:
            self.inner.close(timeout)
        except ShardedSaveError as exc:
            if self.on_error != "warn":
                raise
            _log.warning("sharded checkpoint save failed: %s", exc)
        finally:
            self._handle = None
            self.events.close()


def setup_sharded(callback: Any, trainer: pl.Trainer) -> bool:
    """Give ``callback`` a :class:`ShardedCallbackCheckpointer` on every rank when the strategy writes DCP folders.

    Called from ``AsyncCheckpointCallback.setup`` on every rank, after ``dirpath`` and ``run_id`` are set.
    Collective (creates the checkpoint's gloo group); a failure on any rank raises on every rank.

    Under DDP with the callback's ``ddp_layout="sliced"`` every rank writes a slice of the replicated state
    (:mod:`~lightning_async_ckpt.lightning.sliced`). File-based strategies get a checkpoint IO that also loads
    Lightning DCP folders.

    Returns:
        ``True`` when every rank writes (the callback's ``store``, ``checkpointer`` and committed steps are set),
        ``False`` otherwise (the callback sets up its single writer on rank 0).

    Raises:
        ConfigError: ``admission``/``max_outstanding`` other than ``"wait"``/``1`` (not supported when every rank
            writes), or an unknown ``ddp_layout``.
    """
    layout = getattr(callback, "ddp_layout", "single")
    if layout not in DDP_LAYOUTS:
        raise ConfigError(f"ddp_layout must be one of {DDP_LAYOUTS}, got {layout!r}")
    model_key = model_key_for(trainer.strategy)
    replicated = model_key is None and layout == "sliced" and is_ddp(trainer.strategy) and trainer.world_size > 1
    if model_key is None:
        # File-based strategies load Lightning DCP folders too (a generation written with ddp_layout="sliced").
        install_dcp_loader(trainer.strategy)
        if not replicated:
            return False
        model_key = "state_dict"
    if not replicated:
        guard_strategy_dcp_loads(trainer.strategy)  # its own loader unpickles DCP files without limits
    options = callback.options
    if options.admission != "wait" or options.max_outstanding != 1:
        raise ConfigError(
            f"under {type(trainer.strategy).__name__} every rank writes its shards and one save is in flight at a "
            f"time: use admission='wait' and max_outstanding=1 (got {options.admission!r}, {options.max_outstanding})"
        )
    if callback.checkpointer is not None and not callback.checkpointer.closed:
        return True
    error, store = None, None
    try:
        store = CheckpointStore(callback.dirpath, callback.storage_options, run_id=callback.run_id)
        committed = {g.step for g in store.generations()}
    except Exception as exc:  # noqa: BLE001 - raised below on every rank
        error = exc
    agree_on(trainer, error, "setting up sharded checkpointing")

    # Every rank creates the checkpoint's gloo group (a collective), on the training thread, before training.
    def deferral_blocked(pl_module: Any) -> list[str]:
        return [reason for reasons in override_failures(trainer, pl_module, callback).values() for reason in reasons]

    callback.checkpointer = ShardedCallbackCheckpointer(
        store,
        model_key=model_key,
        rank=trainer.global_rank,
        options=options,
        deferral_blocked=deferral_blocked,
        replicated=replicated,
    )
    callback.checkpointer.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
    callback.store = store
    callback._committed_before = committed
    return True
