"""Peer replicas in Lightning (``replicas=F`` with ``local_dirpath``): the gloo group, the targets from the node
layout, and the ranks' agreement on ``ckpt_path="last"`` (``docs/tiers.md``, "Peer replicas").

Under the single-writer DDP layout rank 0's local generations go to ``i * ranks_per_node`` over a gloo group created
once on every rank (:func:`setup_replicas`); under the DCP layouts
:class:`~lightning_async_ckpt.tiers.tiered_sharded.TieredShardedCheckpointer` replicates every rank's own. Lightning
resolves ``"last"`` before its process group exists, so :func:`ensure_group` sets up the strategy's distributed
environment first (what Lightning does next anyway).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_async_ckpt.lightning.sliced import writes_sharded
from lightning_async_ckpt.tiers.replicas import WRITERS, Replicator, replica_plan

__all__ = ["WRITERS", "ensure_group", "setup_replicas"]

_log = logging.getLogger("lightning_async_ckpt")


def ensure_group(tiers: Any, trainer: Any) -> Any:
    """The replicas' gloo group (created once, collectively, on every rank); the strategy's distributed environment
    is set up first when it is not yet (``"last"`` is resolved before Lightning does it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        trainer.strategy.setup_environment()  # Lightning's own next step; it skips the process group once it exists
    if tiers.group is None:
        tiers.group = dist.new_group(backend="gloo")  # separate from the training group (NCCL on GPUs)
    return tiers.group


def setup_replicas(tiers: Any, trainer: Any) -> None:
    """On every rank at setup: check ``replicas`` against the node layout, join the group, start receiving.

    Raises:
        ConfigError: ``replicas`` is not below the world size, or more than the other nodes can hold.
    """
    if not tiers.replicas or trainer.world_size < 2:
        if tiers.replicas:
            _log.warning("replicas=%d: a single process has no peer; no replicas are made", tiers.replicas)
        return
    world, rank = trainer.world_size, trainer.global_rank
    per_node = max(1, world // max(1, trainer.num_nodes))
    if _writes_dcp(tiers, trainer):  # every rank's own generations: TieredShardedCheckpointer replicates them
        tiers.sharded_replicas = (tiers.replicas, per_node)  # lightning/sharded_tiers.py, at the writer's setup
        tiers.replicator = None
        return
    mine, sources, every = replica_plan(rank, world, replicas=tiers.replicas, ranks_per_node=per_node, writers=WRITERS)
    group = ensure_group(tiers, trainer)
    current = tiers.replicator
    # Idempotent within a fit (two receivers on one link would split its messages); a new fit gets a new sender
    # (the last one closed) and restarts the receivers (they ended at the stop message).
    if current is None or current.closed or (current.targets, current.sources) != (mine, sources):
        tiers.replicator = Replicator(
            group, tiers.local_dirpath, targets=mine, sources=sources, keep_last=tiers.local_keep_last
        )
    tiers.replicator.start_receiving()
    _log.info("replicas of rank %s's local tier go to ranks %s", WRITERS, every)


def _writes_dcp(tiers: Any, trainer: Any) -> bool:
    """Whether this fit writes DCP generations (every rank its own local generation)."""
    callback = next((cb for cb in trainer.callbacks if getattr(cb, "tiers", None) is tiers), None)
    return callback is not None and writes_sharded(callback, trainer)
