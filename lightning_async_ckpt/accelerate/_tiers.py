"""Two tiers for Accelerate: every ``save_state`` cut committed to a node-local tier, the due ones promoted to ``uri``.

:class:`TieredAccelerateCheckpointer` is what :func:`~lightning_async_ckpt.accelerate.attach` returns with
``local_dirpath``: the main process's engine writes ``local_dirpath`` and its commit target promotes each generation
due on the durable cadence (``every_n_train_steps``, ``final=True``, the emergency save) in the background, and hands
it to the peer replicas (``replicas=F``, :mod:`~lightning_async_ckpt.accelerate._replicas`).

The emergency save: ``preemption_signal`` installs a handler that only records the signal; every process's flag
travels with the next ``save_state`` (an exchange on the checkpointer's group), so any process's signal makes that
call the emergency save on every process and :attr:`TieredAccelerateCheckpointer.preempted` true everywhere.
"""

from __future__ import annotations

import time
from typing import Any

from typing_extensions import override

from lightning_async_ckpt.accelerate._checkpointer import AccelerateCheckpointer
from lightning_async_ckpt.accelerate._layout import _log
from lightning_async_ckpt.accelerate._replicas import AccelerateReplicas
from lightning_async_ckpt.core.commit_target import time_left
from lightning_async_ckpt.core.engine import AsyncCheckpointer, CheckpointOptions, SaveHandle
from lightning_async_ckpt.core.preemption import PreemptionHandler, check_preemption
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.promote import Promoter
from lightning_async_ckpt.tiers.target import check_tier_options, promoting_engine
from lightning_async_ckpt.tiers.tiered import local_location

__all__ = ["TieredAccelerateCheckpointer", "check_tier_options"]


class TieredAccelerateCheckpointer(AccelerateCheckpointer):
    """An :class:`AccelerateCheckpointer` whose fully asynchronous saves go to a local tier, promoted to ``uri``.

    Thread-safety: as :class:`AccelerateCheckpointer` (the training thread); promotions run on
    ``lightning_async_ckpt-promote`` and their errors are raised on every process at the next collective call.

    Args:
        accelerator: The ``Accelerator``.
        uri: The durable tier (local folder or fsspec URL).
        local_dirpath: The node-local tier (NVMe, ``/dev/shm``).
        local_every_n_steps: With it, a ``save_state`` at a step due on neither cadence takes no cut (returns
            ``None``), so ``save_state`` can be called after every step; ``None``: every call is a local cut.
        local_keep_last: Retention of the local tier (the newest generation due on ``uri`` is kept until its
            promotion committed).
        promote_every_n_steps: Generations at multiples of this step are promoted (``None``: only ``final=True``,
            ``promote=True`` and the emergency save).
        preemption_signal: A signal that turns the next ``save_state`` into the emergency save.
        preemption_grace_s: The emergency save's bound for the local commit and the promotion together.
        storage_options, defer, options: As :class:`AccelerateCheckpointer` (``options.keep_last`` is ``uri``'s
            retention).
    """

    def __init__(
        self,
        accelerator: Any,
        uri: str,
        *,
        local_dirpath: str,
        local_every_n_steps: int | None,
        local_keep_last: int | None,
        promote_every_n_steps: int | None,
        preemption_signal: Any,
        preemption_grace_s: float | None,
        storage_options: dict[str, Any] | None,
        defer: bool,
        options: CheckpointOptions,
    ) -> None:
        self.local_dirpath = local_dirpath
        self.local_every_n_steps = local_every_n_steps
        self.local_keep_last = local_keep_last
        self.promote_every_n_steps = promote_every_n_steps
        signum, self.preemption_grace_s = check_preemption(preemption_signal, preemption_grace_s)
        self.preemption = PreemptionHandler(signum)
        self.promoter: Promoter | None = None
        self.preempted = False
        #: Peer replicas (set by ``attach(..., replicas=F)`` on every process), else ``None``.
        self.replicas: AccelerateReplicas | None = None
        #: With replicas: the local location every process agreed on (``attach``, ``load_state``), else ``None``.
        self.local_uri: str | None = None
        self.last_emergency: str | None = None
        self._last_cut: SaveHandle | None = None
        self._durable: bool | None = None  # of the cut being taken
        super().__init__(accelerator, uri, storage_options=storage_options, defer=defer, options=options)
        self.preemption.install()

    @property
    def promoted_step(self) -> int | None:
        """The newest step this checkpointer promoted to ``uri`` (main process; ``None`` elsewhere)."""
        return None if self.promoter is None else self.promoter.promoted_step

    def save_state(
        self,
        step: int | None = None,
        *,
        automatic: bool | None = None,
        final: bool = False,
        promote: bool | None = None,
    ) -> SaveHandle | None:  # type: ignore[override]
        """A cut committed to the local tier, promoted to ``uri`` when due; the emergency save when signalled.

        Collective: every process must call it (with the same ``step``). Returns ``None`` when ``local_every_n_steps``
        is set and ``step`` is due on neither cadence (no cut, no exchange unless ``preemption_signal`` is set).

        Args:
            step: The manifest's step; default :attr:`step` (optimizer updates).
            automatic: Not available with two tiers (accelerate's ``checkpoint_N`` folders have one location).
            final: The checkpoint that ends training: copied at the cut and promoted.
            promote: Override the durable cadence for this cut.

        Raises:
            ConfigError: ``automatic=True``, or a bad ``step``.
        """
        self._check_open()
        if automatic:
            raise ConfigError(
                "save_state(automatic=True) writes accelerate's checkpoint_N folders, which have no local tier: "
                "save to the attached uri (attach(accelerator, uri, local_dirpath=...))"
            )
        step = self.step if step is None else step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if self.preemption.signum is not None:
            flags = self._collective(payload=self.preemption.requested.is_set(), doing="the preemption check")
            if any(flags):
                return self.emergency_save(step)
        due = final or (promote if promote is not None else _on(self.promote_every_n_steps, step))
        if self.local_every_n_steps is not None and not due and not _on(self.local_every_n_steps, step):
            return None
        return self._tiered_save(step, final=final, due=due)

    def emergency_save(self, step: int | None = None) -> SaveHandle:
        """Collective: a cut copied at the cut, committed locally, then promoted, within ``preemption_grace_s``.

        The main process waits for both (within the grace period) and logs at WARNING what was committed where
        (:attr:`last_emergency`); :attr:`preempted` is true afterwards on every process.
        """
        step = self.step if step is None else step
        self.preemption.requested.clear()
        # A cut of this step was just taken (save_state, then emergency_save): promote it instead of cutting again.
        last = self._last_cut  # the same on every process: each took part in every cut
        if last is None or last.step != step or last.committed.cancelled() or not last.decision.admitted:
            last = self._tiered_save(step, final=True, due=True)
        self.preempted = True
        if self._main and self._engine is not None:  # the engine's one emergency save: promote that cut, drain
            self.last_emergency = self._engine.emergency_save(step, None, grace_s=self.preemption_grace_s)
        return last

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for this process's local commits, then their promotions and replicas (main process); whether all
        ended in time. Errors stay pending (raised at the next collective call)."""
        engine = self._engine
        if engine is None or not self._main:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        saved = engine.drain_quietly(timeout)
        return engine.target.drain(time_left(deadline)) and saved

    @override
    def close(self, timeout: float | None = None) -> None:
        """:meth:`AccelerateCheckpointer.close` (the engine drains the local commits, then the promotions and the
        replicas, within ``timeout``; collective; raises a save's or a promotion's error on every process), the
        signal handler restored and the replicas' groups released."""
        if self.closed:
            return
        self.preemption.remove()
        try:
            super().close(timeout)
        finally:
            if self.replicas is not None:  # every process: the receivers end, the groups are released
                self.replicas.close(timeout)

    # -- internals -----------------------------------------------------------------------------------------
    def _tiered_save(self, step: int, *, final: bool, due: bool) -> SaveHandle:
        self._durable = due
        try:
            handle = super().save_state(step, automatic=False, final=final)
        finally:
            self._durable = None
        self._last_cut = handle
        return handle

    def _save(self, engine: AsyncCheckpointer, step: int, state: dict, extra: dict[str, Any], **how: Any) -> SaveHandle:
        return super()._save(engine, step, state, extra, durable=self._durable, **how)

    def _get_engine(self) -> AsyncCheckpointer:
        if self._engine is None:
            assert self.uri is not None
            where = self.local_uri or local_location(self.local_dirpath, self.step)
            local = CheckpointStore(where, run_id=self.run_id)
            durable = CheckpointStore(self.uri, self.storage_options, run_id=self.run_id)
            replicator = None if self.replicas is None else self.replicas.replicator
            self._engine = promoting_engine(  # save_state says which cut is durable
                self._new_engine,
                local,
                durable,
                self.options,
                local_keep_last=self.local_keep_last,
                replicas=replicator,
            )
            self.promoter = self._engine.target.copier
            _log.info("local tier of this run: %s (promoted to %s)", local.uri, durable.uri)
        return self._engine

    def _exit(self) -> None:
        self.preemption.remove()
        super()._exit()


def _on(every: int | None, step: int) -> bool:
    return every is not None and step > 0 and step % every == 0
