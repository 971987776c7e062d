"""Two tiers for plain loops: every save committed to a local store, the due ones promoted to a durable store.

:class:`TieredCheckpointer` wraps an :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer` writing the local
tier and a :class:`~lightning_async_ckpt.tiers.promote.Promoter` copying committed local generations to the
durable tier in the background (verified, manifest last; ``docs/tiers.md``). With ``preemption_signal`` it records
the signal; the loop asks :attr:`TieredCheckpointer.preempted` and calls :meth:`TieredCheckpointer.emergency_save`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.handle import SaveHandle
from lightning_async_ckpt.core.options import CheckpointOptions
from lightning_async_ckpt.core.preemption import PreemptionHandler, check_preemption
from lightning_async_ckpt.errors import ConfigError, renamed
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.promote import Promoter
from lightning_async_ckpt.tiers.replicas import Replicator
from lightning_async_ckpt.tiers.tiered_replicas import (
    WRITERS,
    Restored,
    open_replicas,
    require_process_group,
    restore_tiered,
)

__all__ = ["CommitRelay", "Copier", "TieredCheckpointer", "local_location"]

_log = logging.getLogger("lightning_async_ckpt")


def local_location(local_dirpath: str, start_step: int) -> str:
    """Where a run that starts at ``start_step`` writes its local tier: the newest of ``local_dirpath`` and its
    version folders (``v1``, ...) holding no generation newer than ``start_step`` (committed or not), else a new
    version folder, so a damaged or branched-off newer local generation is never overwritten."""
    root = CheckpointStore(local_dirpath, check_writable=False)
    versions = [0, *version_folders(root.fs, root.root)]

    def uri(version: int) -> str:
        return f"{local_dirpath.rstrip('/')}/v{version}" if version else local_dirpath

    for version in reversed(versions):
        store = CheckpointStore(uri(version), check_writable=False) if version else root
        steps = [g.step for g in store.scan(include_uncommitted=True).generations if g.holds_step]
        if not steps or max(steps) <= start_step:
            return uri(version)
    return uri(max(versions) + 1)


class Copier(Protocol):
    """The role that takes a tier's commits onward: told of every local commit, it applies local retention and
    copies the due ones to the durable tier (:class:`~lightning_async_ckpt.tiers.promote.Promoter`, the DCP
    promoter)."""

    def committed(self, step: int, *, promote: bool) -> None:
        """Generation ``step`` committed locally; ``promote`` asks for its copy to the durable tier."""


class CommitRelay:
    """Hands each local commit to the copier (promoted when it was due) and to ``also`` (peer replicas), once.

    Thread-safety: :meth:`track` on the training thread; the hand-over runs on the thread that resolves the commit
    future (the engine's upload thread) or in :meth:`flush` (a waiter may wake before a future's callbacks ran).
    :meth:`flush` returns only once every hand-over started so far has ended, so a drain that follows it sees the
    promotion and the replica of the newest commit queued.

    Args:
        promoter: Told of every local commit (:meth:`Copier.committed`).
        also: Called with each committed step after the promoter (e.g. :meth:`Replicator.replicate`).
    """

    def __init__(self, promoter: Copier, also: Callable[[int], None] | None = None) -> None:
        self.promoter = promoter
        self.also = also
        self._cond = threading.Condition()
        self._due: dict[int, tuple[SaveHandle, bool]] = {}  # id(handle) -> (handle, due), until handed over
        self._delivered: set[int] = set()
        self._handing = 0  # hand-overs running now (on the upload thread, or in flush)
        self._newest: SaveHandle | None = None

    def track(self, handle: SaveHandle, due: bool) -> None:
        """Once ``handle`` commits locally: promote it when ``due``, apply local retention, call ``also``."""
        with self._cond:
            # Handed over ones are dropped, so a long loop keeps only the saves still in flight.
            self._due = {k: v for k, v in self._due.items() if k not in self._delivered}
            self._delivered &= set(self._due)
            self._due[id(handle)] = (handle, due)
            self._newest = handle
        handle.committed.add_done_callback(lambda _: self._deliver(handle))

    def promote(self, step: int) -> SaveHandle | None:
        """Make the newest save, when it is of ``step``, due on the durable tier too (an emergency save right after
        a local cut of the same step); its handle, or ``None`` when the newest save is of another step."""
        with self._cond:
            handle = self._newest
            if handle is None or handle.step != step or handle.committed.cancelled():
                return None
            entry = self._due.get(id(handle))
            if entry is None or entry[1]:  # handed over long ago (not the newest then), or due already
                return handle
            self._due[id(handle)] = (handle, True)
            handed_over = id(handle) in self._delivered
        if handed_over:
            self.promoter.committed(step, promote=True)
        return handle

    def _deliver(self, handle: SaveHandle) -> None:
        future = handle.committed
        if future.cancelled() or future.exception() is not None:
            return
        with self._cond:
            if id(handle) in self._delivered or id(handle) not in self._due:
                return
            self._delivered.add(id(handle))
            self._handing += 1
            due = self._due[id(handle)][1]
        try:
            self.promoter.committed(handle.step, promote=due)
            if self.also is not None:
                self.also(handle.step)
        finally:
            with self._cond:
                self._handing -= 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Hand over every commit seen so far and wait for the hand-overs in progress; whether they all ended
        within ``timeout``."""
        with self._cond:
            handles = [h for h, _ in self._due.values()]
        for handle in handles:
            if handle.committed.done():
                self._deliver(handle)
        with self._cond:
            return self._cond.wait_for(lambda: self._handing == 0, timeout)


class TieredCheckpointer:
    """Asynchronous checkpoints to a local tier, promoted to a durable tier every ``every_n_train_steps``.

    Thread-safety: like :class:`AsyncCheckpointer`, called from one training thread; promotions run on the thread
    ``lightning_async_ckpt-promote``. Their errors are raised once at the next ``save``/``wait``/``poll``/``drain``.

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

    Example::

        ckpt = TieredCheckpointer("/local_nvme/run", "s3://bucket/run", every_n_train_steps=500,
                                  local_keep_last=2, keep_last=3, preemption_signal=signal.SIGUSR1)
        ckpt.attach(model, optimizer)
        for step in range(1, steps + 1):
            train_step()
            if ckpt.preempted:
                ckpt.emergency_save(step, state(), grace_s=60)
                break
            if step % 50 == 0:
                ckpt.save(step, state(), modules=[model], optimizers=[optimizer])
        ckpt.close()
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
        promote_every_n_steps = renamed(
            "every_n_train_steps", every_n_train_steps, "promote_every_n_steps", promote_every_n_steps
        )
        for name, value in (
            ("every_n_train_steps", promote_every_n_steps),
            ("keep_last", keep_last),
            ("local_keep_last", local_keep_last),
            ("replicas", replicas),
            ("ranks_per_node", ranks_per_node),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")
        signum, _ = check_preemption(preemption_signal, None)
        if replicas:
            require_process_group()  # before any thread or handler exists
        self.local = CheckpointStore(local) if isinstance(local, str) else local
        self.durable = CheckpointStore(durable, run_id=self.local.run_id) if isinstance(durable, str) else durable
        if options is None:
            options = CheckpointOptions(**overrides)
        elif overrides:
            options = replace(options, **overrides)
        self.engine = AsyncCheckpointer(self.local, replace(options, keep_last=None))
        self.engine.commit_tier = "local"  # a promotion is its own event, tier="durable"
        self.promoter = Promoter(
            self.local,
            self.durable,
            keep_last=keep_last,
            source_keep_last=local_keep_last,
            on_error=self.engine.report_error,
            on_event=self.engine.events.emit,
            on_commit=lambda manifest: self.engine.commit_hooks.committed(manifest, self.durable, tier="durable"),
        )
        self.promote_every_n_steps = promote_every_n_steps
        self.local_dirpath = local if isinstance(local, str) else self.local.root
        self.group: Any = None
        self.replicator: Replicator | None = None
        if replicas:
            self.group, self.replicator = open_replicas(
                self.local_dirpath, replicas, ranks_per_node=ranks_per_node, keep_last=local_keep_last
            )
            self.replicator.on_error = self.engine.report_error  # raised at the next save/wait/poll/drain
            self.replicator.on_event = self.engine.events.emit
        replicate = None if self.replicator is None else partial(self.replicator.replicate, self.local)
        self.relay = CommitRelay(self.promoter, replicate)
        self.preemption = PreemptionHandler(signum)
        self.preemption.install()

    @property
    def preempted(self) -> bool:
        """Whether ``preemption_signal`` arrived (stays true once it did)."""
        return self.preemption.requested.is_set()

    @property
    def committed_step(self) -> int | None:
        """The newest step committed on the local tier."""
        return self.engine.committed_step

    @property
    def promoted_step(self) -> int | None:
        """The newest step committed on the durable tier by a promotion."""
        return self.promoter.promoted_step

    def attach(self, model: Any, optimizer: Any) -> TieredCheckpointer:
        """Install the plain-loop fences (:meth:`AsyncCheckpointer.attach`)."""
        self.engine.attach(model, optimizer)
        return self

    def save(self, step: int, state: Any, *, promote: bool | None = None, **kwargs: Any) -> SaveHandle:
        """:meth:`AsyncCheckpointer.save` to the local tier; promoted when ``promote`` (default: on the cadence)."""
        if self.replicator is not None and self.group is not None:
            import torch.distributed as dist

            if dist.get_rank() not in WRITERS:
                raise ConfigError(
                    f"with replicas only rank {WRITERS[0]} saves (the single-writer layout: its generation holds the "
                    f"whole state); rank {dist.get_rank()} receives replicas and calls restore() and close() only"
                )
        every = self.promote_every_n_steps
        due = promote if promote is not None else (every is not None and step % every == 0)
        handle = self.engine.save(step, state, **kwargs)
        self.relay.track(handle, due)
        return handle

    def restore(self) -> Restored | None:
        """The generation to resume from: the newest intact local one unless ``durable`` holds a newer committed step,
        then ``durable``'s newest verified one; ``None`` on a first run. Its run continues (the stores' run id).

        With ``replicas`` it is collective (every rank calls it): every rank agrees on one step, and a rank whose
        local folder lacks it receives it from a peer first (:func:`restore_tiered`).
        """
        restored = restore_tiered(self.group, self.local_dirpath, self.durable)
        if restored is not None and restored.manifest.run_id:
            self.local.run_id = self.durable.run_id = restored.manifest.run_id
        return restored

    def add_commit_callback(self, fn: Callable[[Any], Any]) -> None:
        """:meth:`AsyncCheckpointer.add_commit_callback`: each local commit (``tier="local"``) and each promotion
        (``tier="durable"``) is its own call."""
        self.engine.add_commit_callback(fn)

    def wait(self, fence: Any, *, raise_errors: bool = True) -> float:
        """:meth:`AsyncCheckpointer.wait`."""
        return self.engine.wait(fence, raise_errors=raise_errors)

    def poll(self) -> None:
        """Raise a pending error of a save or a promotion."""
        self.engine.poll()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the saves, then their promotions; re-raise a background error. Whether both ended in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        saved = self.engine.drain_quietly(timeout)
        handed = self.relay.flush(_left(deadline))
        promoted = self.promoter.drain(_left(deadline))
        replicated = self.replicator is None or self.replicator.drain(_left(deadline))
        self.engine.deliver_commits()
        self.engine.raise_pending()
        return saved and handed and promoted and replicated

    def emergency_save(self, step: int, state: Any, *, grace_s: float | None = None, **kwargs: Any) -> str:
        """Save ``state`` copied at the cut, commit it locally, promote it within ``grace_s``; say where it landed.

        Returns:
            What was committed where (also logged at WARNING).
        """
        self.preemption.requested.clear()
        deadline = None if grace_s is None else time.monotonic() + grace_s
        if self.relay.promote(step) is None:  # not just cut at this step: cut it now
            self.save(step, state, promote=True, final=True, **kwargs)
        saved = self.engine.drain_quietly(grace_s)
        saved = self.relay.flush(_left(deadline)) and saved
        promoted = self.promoter.drain(_left(deadline))
        where = f"committed step {self.committed_step} to {self.local.uri}" + ("" if saved else " (not in time)")
        where += f"; promoted step {self.promoted_step} to {self.durable.uri}" + ("" if promoted else " (not in time)")
        if self.replicator is not None:
            replicated = self.replicator.drain(_left(deadline))
            where += f"; replicated to ranks {self.replicator.targets}" + ("" if replicated else " (not in time)")
        _log.warning("emergency checkpoint at step %d: %s", step, where)
        return where

    def close(self, timeout: float | None = None) -> None:
        """Drain the saves and promotions (within ``timeout``), stop the threads, restore the signal handler.

        Raises:
            CheckpointError: A save or promotion error not raised yet.
        """
        self.preemption.remove()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.engine.drain_quietly(timeout)
            self.relay.flush(_left(deadline))  # the newest commit's promotion and replica are queued before closing
            self.promoter.close(_left(deadline))
            if self.replicator is not None:
                self.replicator.close(_left(deadline))  # rank 0 tells its targets to stop; they wait for that
        finally:
            self.engine.close(_left(deadline))

    def __enter__(self) -> TieredCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
