"""``AsyncCheckpointCallback`` under sharded strategies: every rank writes its shards in torch DCP's format.

Under ``ModelParallelStrategy`` and ``FSDPStrategy(state_dict_type="sharded")`` the callback drives a
:class:`~lightning_async_ckpt.sharded.ShardedCheckpointer` on every rank and writes what the strategy's own
``save_checkpoint`` writes (DCP files, ``meta.pt`` by rank 0, the manifest last), so a committed generation folder
loads with ``trainer.fit(ckpt_path=folder)``. DCP's collectives run on the checkpointer's own gloo group, never
interleaved with training's. An override of a hook that may write state before a fence turns deferral off for that
save. One save is in flight at a time (``docs/lightning_sharded.md``).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.lightning.collective import agree_on
from lightning_async_ckpt.lightning.hooks import override_failures
from lightning_async_ckpt.lightning.naming import LIGHTNING_META_NAME, is_lightning_dcp_generation, model_key_for
from lightning_async_ckpt.lightning.resume import committed_steps_once
from lightning_async_ckpt.lightning.sharded_tiers import open_tiered_sharded
from lightning_async_ckpt.lightning.sliced import (
    DDP_LAYOUTS,
    guard_strategy_dcp_loads,
    install_dcp_loader,
    is_ddp,
    replicated_only,
)
from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "LIGHTNING_META_NAME",
    "LightningDcpLayout",
    "ShardedSetup",
    "is_lightning_dcp_generation",
    "model_key_for",
    "setup_sharded",
    "to_strategy_layout",
]

_log = logging.getLogger("lightning_async_ckpt")


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


@dataclass
class LightningDcpLayout:
    """How one rank turns Lightning's checkpoint into what the strategy's own ``save_checkpoint`` writes.

    Attributes:
        model_key: :func:`model_key_for` of the strategy.
        rank: This process's global rank (rank 0 writes ``meta.pt``).
        replicated: DDP (``ddp_layout="sliced"``): the state is replicated; ranks other than 0 leave the module's
            buffers out (see :mod:`~lightning_async_ckpt.lightning.sliced`) and DCP deduplicates the rest.
        deferral_blocked: Called with the LightningModule at each cut; returns the reasons deferral is unsafe
            (overridden hooks that may write state before a fence), empty when it may defer.
        every_rank_meta: The local tier: each rank loads from its own folder, so every rank writes ``meta.pt`` and,
            under ``ddp_layout="sliced"``, its whole state (the durable generation names rank 0's copy of what
            DCP de-duplicates, :mod:`~lightning_async_ckpt.tiers.local_tier`).
    """

    model_key: str
    rank: int
    replicated: bool = False
    deferral_blocked: Callable[[Any], list[str]] = lambda module: []
    every_rank_meta: bool = False

    def prepare(
        self, step: int, checkpoint: dict[str, Any], modules: list[Any], defer: bool
    ) -> tuple[dict[str, Any], dict[str, bytes], bool]:
        """Split ``checkpoint`` (consumed) into the DCP state, the extra objects and whether to defer.

        Returns:
            ``(state, {"meta.pt": ...} on rank 0 else {}, defer)``; ``meta.pt`` is serialized here, at the cut.
        """
        state, meta = to_strategy_layout(checkpoint, self.model_key)
        if self.replicated and self.rank != 0 and modules and not self.every_rank_meta:  # local tier: keep all
            state[self.model_key] = replicated_only(state[self.model_key], modules[0])
        objects: dict[str, bytes] = {}
        if self.rank == 0 or self.every_rank_meta:
            buffer = io.BytesIO()
            torch.save(meta, buffer)
            objects[LIGHTNING_META_NAME] = buffer.getvalue()
        blocked_by = self.deferral_blocked(modules[0]) if defer and modules else []
        if blocked_by:
            _log.debug("step %s copied at the cut: %s", step, "; ".join(blocked_by))
        return state, objects, defer and not blocked_by


@dataclass
class ShardedSetup:
    """What :func:`setup_sharded` opened for the callback on this rank.

    Attributes:
        checkpointer: The rank's :class:`~lightning_async_ckpt.sharded.ShardedCheckpointer` (the one engine with
            the DCP persister), fences declared.
        store: Its store.
        layout: How each cut's checkpoint becomes the DCP state and ``meta.pt``.
        committed: Steps already committed in the store (a step the fit would write again is refused).
    """

    checkpointer: ShardedCheckpointer
    store: CheckpointStore
    layout: LightningDcpLayout
    committed: set[int]


def setup_sharded(callback: Any, trainer: pl.Trainer, current: ShardedSetup | None = None) -> ShardedSetup | None:
    """Open a sharded checkpointer on every rank when the strategy writes DCP folders (or DDP writes slices).

    Called from ``AsyncCheckpointCallback.setup`` on every rank; changes nothing on the callback. Collective
    (creates the checkpoint's gloo group); a failure on any rank raises on every rank. File-based strategies get a
    checkpoint IO that also loads Lightning DCP folders.

    Args:
        callback: The ``AsyncCheckpointCallback`` (its arguments are read).
        trainer: The trainer being set up.
        current: What an earlier ``fit`` of this callback opened: kept while its checkpointer is open.

    Returns:
        What every rank writes with, or ``None`` when one writer does (the callback sets up its single writer on
        rank 0).

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
            return None
        model_key = "state_dict"
    if not replicated:
        guard_strategy_dcp_loads(trainer.strategy)  # its own loader unpickles DCP files without limits
    options = callback.options
    if options.admission != "wait" or options.max_outstanding != 1:
        raise ConfigError(
            f"under {type(trainer.strategy).__name__} every rank writes its shards and one save is in flight at a "
            f"time: use admission='wait' and max_outstanding=1 (got {options.admission!r}, {options.max_outstanding})"
        )
    if current is not None and not current.checkpointer.closed:
        return current
    error, store = None, None
    try:
        store = CheckpointStore(callback.dirpath, callback.storage_options, run_id=callback.run_id)
    except Exception as exc:  # noqa: BLE001 - raised below on every rank
        error = exc
    agree_on(trainer, error, "setting up sharded checkpointing")
    assert store is not None
    committed = committed_steps_once(store, trainer)  # listed on rank 0 only, broadcast (raises on every rank)

    def deferral_blocked(pl_module: Any) -> list[str]:
        return [reason for reasons in override_failures(trainer, pl_module, callback).values() for reason in reasons]

    # Every rank creates the checkpoint's gloo group (a collective), on the training thread, before training.
    rank = trainer.global_rank
    tiered = getattr(callback, "tiers", None) is not None
    if tiered:  # local_dirpath: every rank's own local generation, the due ones promoted to store
        checkpointer = open_tiered_sharded(callback, store, options, rank)
    else:
        checkpointer = ShardedCheckpointer(
            store,
            options=replace(options, event_log=options.event_log if rank == 0 else None),
            keep_last=options.keep_last,
            guard=options.guard,
            host_memory_budget=options.host_memory_budget,
        )
    checkpointer.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
    return ShardedSetup(
        checkpointer=checkpointer,
        store=store,
        layout=LightningDcpLayout(model_key, rank, replicated, deferral_blocked, every_rank_meta=tiered),
        committed=committed,
    )
