"""Two tiers for sharded (DCP) plain loops: :class:`TieredShardedCheckpointer`.

A :class:`~lightning_async_ckpt.sharded.checkpointer.ShardedCheckpointer` writing each rank's local tier
(:mod:`.local_tier`) with a :class:`~lightning_async_ckpt.tiers.target.TieredTarget` as its commit target: a
:class:`~lightning_async_ckpt.tiers.promote_dcp.DcpPromoter` promotes the due generations, and :meth:`resume`
agrees on one step of either tier (:mod:`.sharded_resume`). Names follow
:class:`~lightning_async_ckpt.tiers.tiered.TieredCheckpointer`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_async_ckpt.core.options import CheckpointOptions
from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.preemption import check_preemption
from lightning_async_ckpt.errors import ConfigError, renamed
from lightning_async_ckpt.sharded.checkpointer import ShardedCheckpointer
from lightning_async_ckpt.sharded.once import gloo_group
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import gather
from lightning_async_ckpt.tiers.local_tier import LocalTierPersister, rank_store
from lightning_async_ckpt.tiers.peer_replicas import DcpReplicas, check_replicas
from lightning_async_ckpt.tiers.promote_dcp import DcpPromoter
from lightning_async_ckpt.tiers.sharded_resume import TierChoice, latest_across_tiers, local_state, version_root
from lightning_async_ckpt.tiers.target import TieredEngine, TieredTarget, check_tier_options

__all__ = ["TieredShardedCheckpointer"]


class TieredShardedCheckpointer(TieredEngine, ShardedCheckpointer):
    """Asynchronous sharded checkpoints to a node-local tier, promoted to a durable tier every
    ``every_n_train_steps``.

    Construct on every rank in the same order (creates two gloo groups: collectives). Call :meth:`resume` (every
    rank) before the first save to continue a run: it loads the newest generation every rank can load, from either
    tier. Promotion errors are raised once, on every rank, at the next ``save``/``wait``/``poll``/``drain``.

    Args:
        local_dirpath: The node-local folder (``/local_nvme/run``, ``/dev/shm/run``); ranks may share one.
        durable: The durable store (or its URL, opened with ``storage_options``).
        every_n_train_steps: Saves at multiples of this step are promoted (``None``: only ``save(...,
            promote=True)``).
        keep_last: Retention of the durable tier (rank 0, after each promotion).
        local_keep_last: Retention of each rank's local store (the due generations not yet promoted are kept).
        storage_options: For ``durable`` when it is a URL.
        run_id: As for :class:`ShardedCheckpointer`.
        timeout_s: Timeout of the checkpoint and promotion groups.
        thread_count: DCP's I/O threads per rank.
        guard: As for :class:`ShardedCheckpointer`.
        host_memory_budget: As for :class:`ShardedCheckpointer`.
        write_retry: As for :class:`ShardedCheckpointer`.
        options: As for :class:`ShardedCheckpointer`.
        preemption_signal: A signal that sets :attr:`preempted` on the rank that receives it (handler installed
            here, on the main thread, removed by :meth:`close`); :meth:`preemption_due` agrees across ranks.
        replicas: Copy each rank's committed local generations to this many other ranks' local folders (other
            nodes first), in the background; :meth:`resume` restores a rank's lost or damaged part from a peer
            (:mod:`.peer_replicas`); :meth:`emergency_save` waits for them within its grace period. Needs
            ``torch.distributed``.
        ranks_per_node: The node layout for ``replicas`` (``None``: ``LOCAL_WORLD_SIZE``).
        promote_every_n_steps: Former name of ``every_n_train_steps`` (a ``FutureWarning``).

    Raises:
        ConfigError: A bad argument (named).
    """

    def __init__(
        self,
        local_dirpath: str,
        durable: CheckpointStore | str,
        *,
        every_n_train_steps: int | None = None,
        keep_last: int | None = None,
        local_keep_last: int | None = None,
        storage_options: dict[str, Any] | None = None,
        run_id: str | None = None,
        timeout_s: float = 300.0,
        thread_count: int = 1,
        guard: bool | str = True,
        host_memory_budget: int | str | None = None,
        write_retry: RetryPolicy | None = None,
        options: CheckpointOptions | None = None,
        preemption_signal: int | None = None,
        replicas: int | None = None,
        ranks_per_node: int | None = None,
        promote_every_n_steps: int | None = None,
    ) -> None:
        promote_every_n_steps = renamed(
            "every_n_train_steps", every_n_train_steps, "promote_every_n_steps", promote_every_n_steps
        )
        signum, _ = check_preemption(preemption_signal, None)
        check_replicas(replicas, ranks_per_node, local_dirpath if isinstance(local_dirpath, str) else "")
        check_tier_options(
            every_n_train_steps=promote_every_n_steps, keep_last=keep_last, local_keep_last=local_keep_last
        )
        if not isinstance(local_dirpath, str) or not local_dirpath.strip():
            raise ConfigError(f"local_dirpath must be a non-empty node-local path, got {local_dirpath!r}")
        if not isinstance(durable, CheckpointStore | str):
            raise ConfigError(f"durable must be a CheckpointStore or a URL string, got {type(durable).__name__}")
        self.local_dirpath = local_dirpath.rstrip("/")
        self.version = 0
        self.promote_every_n_steps = promote_every_n_steps
        self._tier_args = (durable, storage_options, keep_last, local_keep_last, replicas, ranks_per_node, timeout_s)
        super().__init__(
            self.local_dirpath,
            timeout_s=timeout_s,
            thread_count=thread_count,
            run_id=run_id,
            guard=guard,
            host_memory_budget=host_memory_budget,
            write_retry=write_retry,
            plan_caching=False,
            options=options,
        )
        self.target.bind(self, replica_errors=False)  # type: ignore[attr-defined]
        self._install_preemption(signum)

    def _make_target(self, store: CheckpointStore) -> TieredTarget:
        # Every rank hands its own local commits to the promoter (collective rounds) and its replicas.
        durable, storage_options, keep_last, local_keep_last, replicas, per_node, timeout_s = self._tier_args
        if isinstance(durable, str):
            durable = CheckpointStore(durable, storage_options, run_id=store.run_id)
        self.durable = durable
        self.promoter = DcpPromoter(
            store, durable, keep_last=keep_last, local_keep_last=local_keep_last, timeout_s=timeout_s
        )
        self.replicas = (
            None
            if replicas is None
            else DcpReplicas(
                self.local_dirpath, replicas, ranks_per_node=per_node, keep_last=local_keep_last, timeout_s=timeout_s
            )
        )
        replicator = None if self.replicas is None else self.replicas.replicator
        return TieredTarget(store, durable, self.promoter, replicator, self.promote_every_n_steps, rank=self.rank)

    def _open_store(self, uri: str, storage_options: dict[str, Any] | None, run_id: str | None) -> CheckpointStore:
        return rank_store(uri, self.rank, run_id=run_id)

    def _make_persister(self, store: CheckpointStore, plan_caching: bool) -> Any:
        group = self.process_group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        return LocalTierPersister(
            store,
            process_group=group,
            rank=self.rank,
            world_size=self.world_size,
            thread_count=self.thread_count,
            write_retry=self.write_retry,
        )

    def resume(self, state: dict[str, Any], *, verify: bool = True) -> TierChoice | None:
        """Load the newest generation every rank can load, from either tier, into ``state`` in place (collective).

        Call on every rank before the first save. When a rank's local tier holds a generation newer than the one
        loaded (a damaged or partial one, or a branch), this run writes a new local version folder.

        Returns:
            The choice (step, tier), or ``None`` when neither tier holds one (nothing loaded).
        """
        if self.replicas is not None:
            choice = self.replicas.resume(self.durable, verify=verify)
        else:
            choice = latest_across_tiers(self.local_dirpath, self.durable, verify=verify)
        if choice is not None:
            choice.load(state, process_group=self.process_group)
        self.continue_from(choice.step if choice is not None else 0)
        return choice

    def continue_from(self, start_step: int) -> None:
        """Choose where this run's local generations go, before its first save (collective over the checkpoint
        group): the newest local version folder when no rank holds a generation (or leftover) there newer than
        ``start_step``, else a new version folder (committed names are never rewritten)."""
        _, version, newest = local_state(self.local_dirpath, self.rank, self.world_size)
        everyone = gather(self.process_group, (version, newest))
        top = max(v for v, _ in everyone)
        newest_top = max((n for v, n in everyone if v == top and n is not None), default=None)
        self._use_version(top + 1 if newest_top is not None and newest_top > start_step else top)

    def _use_version(self, version: int) -> None:
        store = rank_store(version_root(self.local_dirpath, version), self.rank, run_id=self.store.run_id)
        self.version = version
        self.store = store
        self.persister.store = store  # type: ignore[attr-defined]
        self.promoter.source = self.target.local = store  # type: ignore[attr-defined]

    def preemption_due(self) -> bool:
        """Whether ``preemption_signal`` arrived at any rank (collective: call on every rank at the same step, on
        the training thread; over the job's default group, or a gloo group beside a non-gloo one)."""
        flag = self.preempted
        if self.process_group is None:
            return flag
        group = None if str(dist.get_backend()) == "gloo" else gloo_group()
        box = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
        return bool(box.item())
