"""Two tiers, one cut: every cut committed to a node-local tier, the generations due on the durable cadence promoted
from there to ``dirpath`` in the background (``docs/tiers.md``).

:class:`Tiers` builds the engine writing the local tier, whose commit target
(:class:`~lightning_async_ckpt.tiers.target.TieredTarget`) promotes a cut when the callback says it is durable and
hands it to the peer replicas (:mod:`~lightning_async_ckpt.lightning.replicas`); a promotion's error is raised once
at the next hook. Resuming across tiers: :mod:`~lightning_async_ckpt.lightning.tier_resume`; DCP generations:
:mod:`~lightning_async_ckpt.lightning.sharded_tiers`.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.lightning.replicas import setup_replicas
from lightning_async_ckpt.lightning.sharded_tiers import place_sharded
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.target import TieredTarget, check_apart, promoting_engine
from lightning_async_ckpt.tiers.tiered import local_location

__all__ = ["Tiers", "open_checkpointer"]

_log = logging.getLogger("lightning_async_ckpt")


class Tiers:
    """The callback's local tier and its promotion to ``dirpath`` (the writing rank's view).

    Thread-safety: called on the training thread.

    Args:
        local_dirpath: The node-local folder (NVMe, ``/dev/shm``) every cut is committed to.
        local_every_n_train_steps: The local cadence (``None``: the durable cadence only).
        local_keep_last: Retention of the local tier (``None``: keep all).
        every_n_train_steps: The durable cadence (the callback's ``every_n_train_steps``).
        replicas: Peer replicas of each local generation on other nodes' local tiers (``None``: none;
            :mod:`~lightning_async_ckpt.lightning.replicas`).
    """

    def __init__(
        self,
        *,
        local_dirpath: str,
        local_every_n_train_steps: int | None,
        local_keep_last: int | None,
        every_n_train_steps: int | None,
        replicas: int | None = None,
    ) -> None:
        self.local_dirpath = local_dirpath
        self.replicas = replicas
        self.group: Any = None  # the replicas' gloo group, created once (lightning/replicas.py)
        self.replicator: Any = None
        self.local_every_n_train_steps = local_every_n_train_steps or None
        self.local_keep_last = local_keep_last
        self.every_n_train_steps = every_n_train_steps or None
        self.local_store: CheckpointStore | None = None
        self.promoter: Any = None  # this fit's (the engine's target holds it)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled callback (LightningCLI, deepcopy) carries the configuration, not the stores and threads.
        state = dict(self.__dict__)
        state.update(local_store=None, promoter=None, group=None, replicator=None)
        return state

    # -- setup -------------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """On every rank at setup, after the process group exists: the peer replicas' group and receivers (with
        ``replicas``; nothing otherwise)."""
        setup_replicas(self, trainer)

    def checkpointer(self, store: CheckpointStore, options: Any, local_uri: str | None = None) -> AsyncCheckpointer:
        """The engine writing the local tier, and the promoter from it to ``store`` (the durable tier)."""
        check_apart(store.uri, self.local_dirpath)  # dirpath=None and "" are known here, at setup
        self.local_store = CheckpointStore(local_uri or self.local_dirpath, run_id=store.run_id, check_writable=False)
        self.local_store.backend.check_writable(self.local_store.root, self.local_store.uri, name="local_dirpath")
        engine = promoting_engine(
            AsyncCheckpointer,
            self.local_store,
            store,
            options,
            local_keep_last=self.local_keep_last,
            replicas=self.replicator,
        )  # the callback says which saves are durable
        engine.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
        self.promoter = engine.target.copier
        return engine

    def place(self, engine: Any, store: CheckpointStore, options: Any, start_step: int) -> Any:
        """At train start, after ``place_run`` chose the durable location ``store``: the engine of this fit's local
        location (``engine`` itself when it already writes there).

        The local tier continues in the newest of ``local_dirpath`` and its version folders where no generation is
        newer than the step training starts from; otherwise (a damaged or branched-off newer local generation) the fit writes
        a new local version, so nothing there is overwritten.
        """
        if engine is None or engine.writes_dcp:  # sharded: every rank's local tier (lightning/sharded_tiers.py)
            return place_sharded(self, engine, start_step)
        target = local_location(self.local_dirpath, start_step)  # the newest version where this fit continues
        local = self.local_store
        promoter = self.promoter
        if (
            engine.store is not local
            or local is None
            or target != local.uri
            or promoter is None
            or promoter.target is not store
        ):
            if isinstance(engine.target, TieredTarget):
                engine.target.replicas = None  # the fit's replicator goes on with the next engine
            engine.close()  # nothing was saved yet: place_run may have opened one on the durable store
            engine = self.checkpointer(store, options, target)
            _log.info("local tier of this run: %s", target)
        assert self.local_store is not None
        self.local_store.run_id = store.run_id
        return engine

    # -- cuts --------------------------------------------------------------------------------------------
    def local_due(self, step: int) -> bool:
        """Whether the local cadence takes a cut at ``step``."""
        n = self.local_every_n_train_steps
        return n is not None and step > 0 and step % n == 0

    def durable_due(self, step: int, *, ranked: bool | None, final: bool) -> bool:
        """Whether the generation of a cut at ``step`` is promoted to ``dirpath``."""
        m = self.every_n_train_steps
        return final or bool(ranked) or (m is not None and step % m == 0)

    @property
    def promoted_step(self) -> int | None:
        """The newest step committed on ``dirpath`` by a promotion of this fit."""
        return None if self.promoter is None else self.promoter.promoted_step


def open_checkpointer(store: CheckpointStore, options: Any, tiers: Tiers | None) -> AsyncCheckpointer:
    """The callback's engine: writing ``store``, or with ``tiers`` the local tier promoted to ``store``."""
    if tiers is not None:
        return tiers.checkpointer(store, options)
    engine = AsyncCheckpointer(store, options)
    engine.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
    return engine
