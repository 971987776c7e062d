"""Two tiers as the engine's commit target: each local commit promoted where due and handed to the peer replicas.

The engine hands :class:`TieredTarget` every local commit on its upload thread, before the save's ``committed``
future resolves, so a drained engine has handed its newest commit over; :meth:`TieredTarget.drain` then waits for
the promotion and the replicas (the copier, a :class:`~lightning_async_ckpt.tiers.background.PromotionQueue`, and the
role :class:`Replicas`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from lightning_async_ckpt.core.commit_target import time_left
from lightning_async_ckpt.core.preemption import PreemptionHandler
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.root import comparable_path
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import PromotionQueue
from lightning_async_ckpt.tiers.promote import DURABLE_TIER_KEY, Promoter

__all__ = [
    "Replicas",
    "TieredEngine",
    "TieredTarget",
    "check_apart",
    "check_tier_options",
    "promoting_engine",
]


def check_tier_options(**values: Any) -> None:
    """Validate the step counts and retentions of the tiers (``None`` or an int >= 1).

    Raises:
        ConfigError: Naming the argument.
    """
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")


def check_apart(dirpath: str, local_dirpath: str) -> None:
    """Refuse a ``local_dirpath`` that is ``dirpath``, inside it, or holds it: each tier's retention would see the
    other's generations as its own.

    Raises:
        ConfigError: Naming both folders and the fix.
    """
    durable, local = comparable_path(dirpath), comparable_path(local_dirpath)
    if durable == local or durable.startswith(local + "/") or local.startswith(durable + "/"):
        raise ConfigError(
            f"local_dirpath {local_dirpath!r} and dirpath {dirpath!r} overlap: the local tier needs a separate "
            "node-local folder (e.g. /local_nvme/ckpt or /dev/shm/ckpt) outside dirpath, and dirpath must not lie "
            "inside it"
        )


class Replicas(Protocol):
    """Copies each local commit to peers' local tiers (:class:`~lightning_async_ckpt.tiers.replicas.Replicator`)."""

    targets: list[int]
    replicated: dict[int, list[int]]
    on_error: Any
    on_event: Any

    def replicate(self, store: CheckpointStore, step: int) -> None:
        """Send committed generation ``step`` of ``store`` to the targets, in the background."""

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the replications asked for; whether they ended within ``timeout``."""

    def close(self, timeout: float | None = None) -> bool:
        """Finish the replications asked for, stop the peers' receivers and the threads."""


class TieredTarget:
    """A local and a durable tier beneath one engine (module docstring).

    Thread-safety: :meth:`committed` runs on the engine's upload thread, :meth:`make_durable`, :meth:`drain` and
    :meth:`close` on the training thread.

    Args:
        local: The local tier the engine writes (reassigned when a run moves to a new local version folder).
        durable: The durable tier.
        copier: Promotes the due generations and runs local retention.
        replicas: Peer replicas of each local commit (``None``: none).
        every_n_steps: The durable cadence of saves that do not say (``None``: only the durable ones).
        rank: This rank, for the emergency line.
        writers: The ranks that save (``None``: every rank); the others only receive replicas and restore.
    """

    def __init__(
        self,
        local: CheckpointStore,
        durable: CheckpointStore,
        copier: PromotionQueue,
        replicas: Replicas | None = None,
        every_n_steps: int | None = None,
        *,
        rank: int = 0,
        writers: tuple[int, ...] | None = None,
    ) -> None:
        check_apart(durable.uri, local.uri)
        self.local, self.durable = local, durable
        self.writers = writers
        self.copier, self.replicas = copier, replicas
        self.every_n_steps = every_n_steps
        self.rank = rank
        self._lock = threading.Lock()
        self._newest: tuple[int, bool] | None = None  # the newest commit handed over: (step, promoted)
        self._made_durable: set[int] = set()  # steps made durable before their commit was handed over

    def bind(self, engine: Any, *, replica_errors: bool = True) -> None:
        """Report the copier's (and with ``replica_errors`` the replicas') failures and events through ``engine``,
        and its durable commits to ``engine``'s commit hooks (``tier="durable"``; the local ones say ``"local"``)."""
        engine.commit_tier = "local"
        self.copier.on_error, self.copier.on_event = engine.report_error, engine.events.emit
        self.copier.on_commit = lambda manifest: engine.commit_hooks.committed(manifest, self.durable, tier="durable")
        if self.replicas is not None:
            self.replicas.on_event = engine.events.emit
            if replica_errors:
                self.replicas.on_error = engine.report_error

    def check_save(self) -> None:
        """Refuse a save on a rank that only receives replicas (the single-writer layout)."""
        if self.writers is not None and self.rank not in self.writers:
            raise ConfigError(
                f"with replicas only rank {self.writers[0]} saves (the single-writer layout: its generation holds the "
                f"whole state); rank {self.rank} receives replicas and calls restore() and close() only"
            )

    def manifest_extra(self) -> dict[str, Any]:
        """The durable tier this local generation belongs to (its run lineage at resume)."""
        return {DURABLE_TIER_KEY: self.durable.root}

    def due(self, step: int) -> bool:
        """Whether ``step`` is on the durable cadence."""
        return self.every_n_steps is not None and step % self.every_n_steps == 0

    def committed(self, step: int, durable: bool | None) -> None:
        """Promote ``step`` when ``durable`` (``None``: on the cadence) or made durable meanwhile; replicate it."""
        with self._lock:
            promote = (self.due(step) if durable is None else durable) or step in self._made_durable
            self._made_durable = {s for s in self._made_durable if s > step}
            self._newest = (step, promote)
        self.copier.committed(step, promote=promote)
        if self.replicas is not None:
            self.replicas.replicate(self.local, step)

    def make_durable(self, step: int) -> bool:
        """Promote ``step`` (the engine's newest save) too: now when it was handed over, else at its hand-over."""
        with self._lock:
            newest = self._newest
            if newest is None or newest[0] != step:
                self._made_durable.add(step)
                return True
            if newest[1]:
                return True
            self._newest = (step, True)
        self.copier.committed(step, promote=True)
        return True

    def drain(self, timeout: float | None) -> bool:
        """Wait for the promotions and the replicas asked for; whether both ended within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        promoted = self.copier.drain(timeout)
        return (self.replicas is None or self.replicas.drain(time_left(deadline))) and promoted

    def close(self, timeout: float | None) -> None:
        """Finish and stop the promotions, then the replicas (the peers stop receiving), within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.copier.close(timeout)
        finally:
            if self.replicas is not None:
                self.replicas.close(time_left(deadline))

    def report(self, step: int) -> str:
        """``"; promoted step ... to ...; replicated rank r's step ... to ranks [...]"``."""
        where = f"; promoted step {self.copier.promoted_step} to {self.durable.uri}"
        if self.replicas is not None and self.replicas.targets:
            done = sorted(set(self.replicas.replicated.get(step, [])))
            missing = [t for t in self.replicas.targets if t not in done]
            where += f"; replicated rank {self.rank}'s step {step} to ranks {done}"
            if missing:
                where += f" (not to ranks {missing}: failed, not committed or not in time)"
        return where


class TieredEngine:
    """What the tiered checkpointers of plain loops add to their engine (mixed in before it): :attr:`preempted`
    and :attr:`promoted_step`, and the engine's signal handler installed by :meth:`_install_preemption` (the
    engine's emergency save clears it, its ``close`` removes it)."""

    preemption: PreemptionHandler
    promoter: PromotionQueue

    def _install_preemption(self, signum: int | None) -> None:
        self.preemption = PreemptionHandler(signum)
        self.preemption.install()

    @property
    def preempted(self) -> bool:
        """Whether ``preemption_signal`` arrived (at this rank; until the emergency save)."""
        return self.preemption.requested.is_set()

    @property
    def promoted_step(self) -> int | None:
        """The newest step committed on the durable tier by a promotion."""
        return self.promoter.promoted_step


def promoting_engine(
    make_engine: Callable[..., Any],
    local: CheckpointStore,
    durable: CheckpointStore,
    options: Any,
    *,
    local_keep_last: int | None,
    replicas: Replicas | None,
) -> Any:
    """``make_engine(local, options, target=...)``: an engine writing ``local`` whose :class:`TieredTarget` promotes
    the saves that say ``durable`` with a :class:`~lightning_async_ckpt.tiers.promote.Promoter` (bound to the engine;
    ``options.keep_last`` is the durable tier's retention, ``local_keep_last`` the promoter's of the local tier) and
    hands each commit to ``replicas``."""
    promoter = Promoter(local, durable, keep_last=options.keep_last, source_keep_last=local_keep_last)
    target = TieredTarget(local, durable, promoter, replicas)
    engine = make_engine(local, replace(options, keep_last=None), target=target)
    target.bind(engine)  # failures raised at the next hook / collective; events logged; durable commit hooks
    return engine
