"""``AsyncCheckpointCallback(local_dirpath=...)`` under sharded strategies and ``ddp_layout="sliced"``: the two tiers
of DCP generations (``docs/tiers.md``, "Sharded and sliced layouts").

Every rank writes a self-contained local generation into ``<local_dirpath>/rank-<r>``
(:class:`~lightning_async_ckpt.tiers.tiered_sharded.TieredShardedCheckpointer`); the due ones are promoted by every
rank together. ``ckpt_path="last"``: every rank agrees on one step (:func:`find_last_sharded`, a collective); a rank
then loads its own local folder, or every rank the durable generation when any rank's part is missing, damaged or
behind (with ``replicas=F``, a missing or damaged part is first restored from a peer's intact replica).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["find_last_sharded", "open_tiered_sharded", "place_sharded"]

_log = logging.getLogger("lightning_async_ckpt")
# The strategy attribute holding this rank's agreed local folder until the strategy loads it.
_LOCAL_PATH = "_lightning_async_ckpt_local_path"


def open_tiered_sharded(callback: Any, store: CheckpointStore, options: Any, rank: int) -> Any:
    """The rank's two-tier sharded checkpointer (collective: creates its groups), registered with the callback's
    tiers so that the callback's due saves are promoted to ``store``."""
    from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer

    tiers = callback.tiers
    replicas, per_node = getattr(tiers, "sharded_replicas", None) or (None, None)  # lightning/replicas.py
    checkpointer = TieredShardedCheckpointer(
        tiers.local_dirpath,
        store,
        keep_last=options.keep_last,
        local_keep_last=tiers.local_keep_last,
        run_id=store.run_id,
        guard=options.guard,
        host_memory_budget=options.host_memory_budget,
        options=replace(options, event_log=options.event_log if rank == 0 else None, keep_last=None),
        replicas=replicas,
        ranks_per_node=per_node,
    )
    tiers.local_store, tiers.promoter = checkpointer.store, checkpointer.promoter
    return checkpointer


def place_sharded(tiers: Any, engine: Any, start_step: int) -> Any:
    """At train start (every rank): this fit's local version folder, a new one when any rank holds a local step
    newer than ``start_step`` (collective over the checkpoint group); ``engine`` itself."""
    if engine is not None:
        engine.continue_from(start_step)
        tiers.local_store = engine.store
    return engine


def find_last_sharded(callback: Any, trainer: Any) -> set[str]:
    """``ckpt_path="last"`` of a sharded fit with ``local_dirpath``: the agreed step, this rank's own local folder
    when every rank holds it intact, else the durable generation on every rank (collective)."""
    import torch.distributed as dist

    from lightning_async_ckpt.lightning import resume
    from lightning_async_ckpt.lightning.arguments import resolve_dirpath
    from lightning_async_ckpt.tiers.sharded_resume import latest_across_tiers

    if not dist.is_initialized():
        trainer.strategy.setup_environment()  # Lightning's own next step; it skips the process group once it exists
    dirpath = resolve_dirpath(callback.dirpath, trainer.default_root_dir)
    durable = CheckpointStore(dirpath, callback.storage_options, check_writable=False)
    if callback.tiers.replicas and trainer.world_size > 1:  # a rank's lost part restored from a peer's replica
        from lightning_async_ckpt.lightning.replicas import ensure_group
        from lightning_async_ckpt.tiers.peer_replicas import local_from_peers

        choice = local_from_peers(ensure_group(callback.tiers, trainer), callback.tiers.local_dirpath, durable)
    else:
        choice = latest_across_tiers(callback.tiers.local_dirpath, durable)
    if choice is not None and choice.tier == "local":
        path = choice.store.url(choice.step)
        _log.info("ckpt_path='last' resumes step %d from this rank's local tier: %s", choice.step, path)
        _load_own_folder(trainer.strategy, path)
        return {path}
    return resume.find_last(callback, trainer)


def _load_own_folder(strategy: Any, path: str) -> None:
    """Make the strategy load ``path`` on this rank (its own local folder, agreed step).

    Sharded strategies broadcast rank 0's checkpoint path before loading ("a common path"); a rank's local tier is
    its own folder (another node's folder does not exist here), and every rank has agreed on the step already, so
    that one load skips the broadcast of the path. Any other path loads as the strategy does.
    """
    setattr(strategy, _LOCAL_PATH, path)
    if getattr(strategy, "_lightning_async_ckpt_own_folder", False):
        return
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        mine = getattr(strategy, _LOCAL_PATH, None)
        if mine is None or os.fspath(checkpoint_path) != mine:
            return original(checkpoint_path, *args, **kwargs)
        setattr(strategy, _LOCAL_PATH, None)
        strategy.broadcast = lambda obj, src=0: obj  # this one call: every rank passes its own agreed folder
        try:
            return original(checkpoint_path, *args, **kwargs)
        finally:
            del strategy.broadcast

    strategy.load_checkpoint = load_checkpoint
    strategy._lightning_async_ckpt_own_folder = True  # the durable tier's newest verified generation, on every rank
