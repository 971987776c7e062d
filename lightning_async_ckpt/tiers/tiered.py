"""Two tiers for plain loops: every save committed to a local store, the due ones promoted to a durable store.

:class:`TieredCheckpointer` is the :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer` writing the local
tier, with a :class:`~lightning_async_ckpt.tiers.target.TieredTarget` as its commit target: a
:class:`~lightning_async_ckpt.tiers.promote.Promoter` copies the due committed local generations to the durable
tier in the background (verified, manifest last; ``docs/tiers.md``), a replicator copies each to peers. With
``preemption_signal`` it records the signal; the loop asks :attr:`TieredCheckpointer.preempted` and calls :meth:`TieredCheckpointer.emergency_save`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.options import CheckpointOptions
from lightning_async_ckpt.core.preemption import check_preemption
from lightning_async_ckpt.errors import renamed
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.promote import Promoter
from lightning_async_ckpt.tiers.replicas import Replicator
from lightning_async_ckpt.tiers.resume import version_store
from lightning_async_ckpt.tiers.target import TieredEngine, TieredTarget, check_tier_options
from lightning_async_ckpt.tiers.tiered_replicas import (
    WRITERS,
    Restored,
    open_replicas,
    require_process_group,
    restore_tiered,
)

__all__ = ["TieredCheckpointer", "local_location", "local_versions"]

_log = logging.getLogger("lightning_async_ckpt")


def local_versions(local_dirpath: str, start_step: int) -> tuple[int, list[int]]:
    """The version :func:`local_location` picks, and the version folders holding a generation newer than
    ``start_step`` (committed or not)."""
    root = CheckpointStore(local_dirpath, check_writable=False)
    versions = [0, *version_folders(root.fs, root.root)]
    newer = [
        v
        for v in versions
        if any(g.holds_step and g.step > start_step for g in version_store(local_dirpath, v).scan().generations)
    ]
    free = [v for v in versions if v not in newer]
    return (max(free) if free else max(versions) + 1), newer


def local_location(local_dirpath: str, start_step: int) -> str:
    """Where a run that starts at ``start_step`` writes its local tier: the newest of ``local_dirpath`` and its
    version folders (``v1``, ...) holding no generation newer than ``start_step`` (committed or not), else a new
    version folder, so a damaged or branched-off newer local generation is never overwritten."""
    version, _ = local_versions(local_dirpath, start_step)
    return f"{local_dirpath.rstrip('/')}/v{version}" if version else local_dirpath


class TieredCheckpointer(TieredEngine, AsyncCheckpointer):
    """Asynchronous checkpoints to a local tier, promoted to a durable tier every ``every_n_train_steps``.

    Thread-safety: like :class:`AsyncCheckpointer`, called from one training thread; promotions run on the thread
    ``lightning_async_ckpt-promote``. Their errors are raised once at the next ``save``/``wait``/``poll``/``drain``.
    ``drain``, ``close`` and ``emergency_save`` are the engine's: they cover the promotions and the replicas.

    Args:
        local: The node-local store (or a path).
        durable: The durable store (or a URL).
        every_n_train_steps: Saves at multiples of this step are promoted (``None``: only those asked with
            ``save(..., promote=True)`` and the emergency save).
        keep_last: Retention of the durable tier.
        local_keep_last: Retention of the local tier (the newest generation due on the durable tier is kept until
            its promotion committed).
        preemption_signal: A signal that sets :attr:`preempted` (handler installed here, on the main thread,
            removed by :meth:`close`).
        replicas: Under ``torch.distributed``: copy each local commit to this many other ranks' local tiers over a
            separate gloo group (created here: construct it on every rank), on other nodes by the node layout
            (:mod:`~lightning_async_ckpt.tiers.tiered_replicas`). Rank 0 saves, alone; :meth:`restore` on every rank.
        ranks_per_node: The node layout for ``replicas`` (default ``LOCAL_WORLD_SIZE``, else one node).
        options: Engine options for the local tier (``keep_last`` there is ignored: retention is per tier).
        promote_every_n_steps: Former name of ``every_n_train_steps`` (a ``FutureWarning``).
        **overrides: Any :class:`CheckpointOptions` field.

    Example: ``docs/tiers.md``, "Plain loops" (``preempted`` checked each step, ``emergency_save`` when set).
    """

    def __init__(
        self,
        local: CheckpointStore | str,
        durable: CheckpointStore | str,
        *,
        every_n_train_steps: int | None = None,
        keep_last: int | None = None,
        local_keep_last: int | None = None,
        preemption_signal: int | None = None,
        replicas: int | None = None,
        ranks_per_node: int | None = None,
        options: CheckpointOptions | None = None,
        promote_every_n_steps: int | None = None,
        **overrides: Any,
    ) -> None:
        every = renamed("every_n_train_steps", every_n_train_steps, "promote_every_n_steps", promote_every_n_steps)
        check_tier_options(
            every_n_train_steps=every,
            keep_last=keep_last,
            local_keep_last=local_keep_last,
            replicas=replicas,
            ranks_per_node=ranks_per_node,
        )
        signum, _ = check_preemption(preemption_signal, None)
        if replicas:
            require_process_group()  # before any thread or handler exists
        self.local = CheckpointStore(local) if isinstance(local, str) else local
        self.durable = CheckpointStore(durable, run_id=self.local.run_id) if isinstance(durable, str) else durable
        if options is None:
            options = CheckpointOptions(**overrides)
        elif overrides:
            options = replace(options, **overrides)
        self.promoter = Promoter(self.local, self.durable, keep_last=keep_last, source_keep_last=local_keep_last)
        self.local_dirpath = local if isinstance(local, str) else self.local.root
        self.group: Any = None
        self.replicator: Replicator | None = None
        if replicas:
            self.group, self.replicator = open_replicas(
                self.local_dirpath, replicas, ranks_per_node=ranks_per_node, keep_last=local_keep_last
            )
        rank, writers = (dist.get_rank(), WRITERS) if self.replicator is not None else (0, None)
        target = TieredTarget(
            self.local, self.durable, self.promoter, self.replicator, every, rank=rank, writers=writers
        )
        # Retention of the local tier is the promoter's: it keeps the generation due on the durable tier.
        super().__init__(self.local, replace(options, keep_last=None), target=target)
        target.bind(self)
        self.promote_every_n_steps = every
        self._install_preemption(signum)

    @property
    def engine(self) -> TieredCheckpointer:
        """This checkpointer (the engine writing the local tier)."""
        return self

    @override
    def restore(self) -> Restored | None:
        """The generation to resume from: the newest intact local one unless ``durable`` holds a newer committed step,
        then ``durable``'s newest verified one; ``None`` on a first run. Its run continues (the stores' run id); when the
        local tier holds a generation newer than the one restored, this run writes a new local version folder (``v1``).

        With ``replicas`` it is collective (every rank calls it): every rank agrees on one step, and a rank whose
        local folder lacks it receives it from a peer first (:func:`restore_tiered`).
        """
        restored = restore_tiered(self.group, self.local_dirpath, self.durable)
        if restored is not None and restored.manifest.run_id:
            self.local.run_id = self.durable.run_id = restored.manifest.run_id
        self._continue_from(restored.step if restored is not None else 0)
        return restored

    def _continue_from(self, start_step: int) -> None:
        """Write this run's local generations to a new version folder when the local tier holds one newer than
        ``start_step`` (damaged, uncommitted or another run's): committed names are never rewritten."""
        uri = local_location(self.local_dirpath, start_step)
        if uri != self.local.uri:
            _log.info("local generations newer than step %d exist: this run writes %s", start_step, uri)
            root = self.local.location
            store = CheckpointStore(
                uri, root.storage_options, run_id=self.local.run_id, checksum=root.checksum, direct_io=root.direct_io
            )
            self.local = self.store = self.promoter.source = self.target.local = store  # type: ignore[attr-defined]
            self.persister.target = store  # type: ignore[attr-defined]
