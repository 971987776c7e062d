"""Two tiers, one cut: every cut is committed to a node-local tier, and the generations due on the durable cadence
are promoted from there to ``dirpath`` in the background (:class:`~lightning_async_ckpt.storage.promote.Promoter`).

The engine (:class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`) writes the local tier
(``local_dirpath``): staged once, committed with its manifest last. A generation due on the durable cadence
(``every_n_train_steps``, the epoch and validation triggers, the final and the emergency checkpoint) is copied
from its committed local objects to ``dirpath``, verified against the local manifest's checksums, and committed
there with its own manifest last. Nothing of a promotion runs on the training thread; its errors are queued in the
engine (``report_error``) and raised once at the next hook like a failed save's.

Resuming (:func:`latest_checkpoint` with ``local_dirpath``, ``ckpt_path="last"``) takes the newest verified
generation of either tier: the local one when it is at least as new and intact, else the durable one. Only
single-file generations have tiers for now (not DCP/sharded ones, not ``ddp_layout="sliced"``).

With ``replicas`` every local commit is also copied to peers' local tiers on other nodes, and ``"last"`` is agreed by
every rank, restoring a lost local tier from a peer (:mod:`~lightning_async_ckpt.lightning.replicas`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.lightning import resume
from lightning_async_ckpt.lightning.arguments import resolve_dirpath
from lightning_async_ckpt.lightning.last import weights_only
from lightning_async_ckpt.lightning.naming import CHECKPOINT_NAME, loadable_path
from lightning_async_ckpt.lightning.replicas import agree_on_local, setup_replicas
from lightning_async_ckpt.lightning.rerun import run_locations, version_uri
from lightning_async_ckpt.lightning.sharded_tiers import find_last_sharded, place_sharded, writes_sharded
from lightning_async_ckpt.storage.finder import list_steps, newest_intact
from lightning_async_ckpt.storage.promote import Promoter
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["Tiers", "emergency_drain", "find_last_across", "latest_checkpoint", "open_checkpointer"]

_log = logging.getLogger("lightning_async_ckpt")
_STEP_IN_PATH = re.compile(r"step-(\d{8,})(?:/|$)")


@dataclass(frozen=True)
class _Local:
    step: int
    path: str
    version: int = 0


class Tiers:
    """The callback's local tier and its promotion to ``dirpath`` (the writing rank's view).

    Thread-safety: called on the training thread, except :meth:`track`'s commit callback (the upload thread).

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
        self.promoter: Promoter | None = None
        self._lock = threading.Lock()
        self._delivered: set[int] = set()
        self._tracked: list[Any] = []
        self._durable: dict[int, bool] = {}

    def __getstate__(self) -> dict[str, Any]:
        # A pickled callback (LightningCLI, deepcopy) carries the configuration, not the stores and threads.
        state = dict(self.__dict__)
        state.update(local_store=None, promoter=None, _lock=None, _delivered=set(), _tracked=[], _durable={})
        state.update(group=None, replicator=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- setup -------------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """On every rank at setup, after the process group exists: the peer replicas' group and receivers (with
        ``replicas``; nothing otherwise)."""
        setup_replicas(self, trainer)

    def checkpointer(self, store: CheckpointStore, options: Any, local_uri: str | None = None) -> AsyncCheckpointer:
        """The engine writing the local tier, and the promoter from it to ``store`` (the durable tier)."""
        self.local_store = CheckpointStore(local_uri or self.local_dirpath, run_id=store.run_id)
        # Retention of the local tier is the promoter's: it keeps the generation being promoted.
        engine = AsyncCheckpointer(self.local_store, replace(options, keep_last=None))
        engine.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
        self.promoter = Promoter(
            self.local_store,
            store,
            keep_last=options.keep_last,
            source_keep_last=self.local_keep_last,
            on_error=engine.report_error,
            on_event=engine.events.emit,  # promoted / promotion_failed / promotion_skipped in the event log
        )
        self._delivered, self._tracked, self._durable = set(), [], {}
        if self.replicator is not None:
            self.replicator.on_error = engine.report_error  # a failed replica is raised like a failed promotion
            self.replicator.on_event = engine.events.emit  # replicated / replica_failed in the event log
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
        target = self._local_location(start_step)
        local = self.local_store
        promoter = self.promoter
        if (
            engine.store is not local
            or local is None
            or target != local.uri
            or promoter is None
            or promoter.target is not store
        ):
            engine.close()  # nothing was saved yet: place_run may have opened one on the durable store
            if promoter is not None:
                promoter.close()
            engine = self.checkpointer(store, options, target)
            _log.info("local tier of this run: %s", target)
        assert self.local_store is not None
        self.local_store.run_id = store.run_id
        return engine

    def _local_location(self, start_step: int) -> str:
        # The newest version where this fit can continue: a run that moved to v1 once keeps writing (and retaining)
        # there instead of going back to the older folder.
        locations = run_locations(self.local_dirpath)
        for loc in reversed(locations):
            steps = [g.step for g in loc.store.scan(include_uncommitted=True).generations if g.holds_step]
            if not steps or max(steps) <= start_step:
                return version_uri(self.local_dirpath, loc.version)
        return version_uri(self.local_dirpath, max(loc.version for loc in locations) + 1)

    # -- cuts --------------------------------------------------------------------------------------------
    def local_due(self, step: int) -> bool:
        """Whether the local cadence takes a cut at ``step``."""
        n = self.local_every_n_train_steps
        return n is not None and step > 0 and step % n == 0

    def durable_due(self, step: int, *, ranked: bool | None, final: bool) -> bool:
        """Whether the generation of a cut at ``step`` is promoted to ``dirpath``."""
        m = self.every_n_train_steps
        return final or bool(ranked) or (m is not None and step % m == 0)

    def track(self, handle: Any, *, durable: bool) -> None:
        """Once the save of ``handle`` commits locally: promote it when ``durable``, and apply local retention."""
        if handle is None:
            return
        with self._lock:
            # Handed over ones are dropped, so a long run keeps only the saves still in flight.
            self._tracked = [h for h in self._tracked if h.step not in self._delivered]
            self._delivered &= {h.step for h in self._tracked}
            self._durable = {h.step: self._durable.get(h.step, False) for h in self._tracked}
            self._tracked.append(handle)
            self._durable[handle.step] = durable
        handle.committed.add_done_callback(lambda _: self._deliver(handle))

    def promote(self, step: int) -> None:
        """Make the save of ``step`` (already requested) due on ``dirpath`` too (the emergency save of a step the
        local cadence had just cut)."""
        with self._lock:
            handed_over = step in self._delivered and not self._durable.get(step, False)
            self._durable[step] = True
        if handed_over and self.promoter is not None:
            self.promoter.committed(step, promote=True)

    def _deliver(self, handle: Any) -> None:
        future = handle.committed
        if future.cancelled() or future.exception() is not None or self.promoter is None:
            return
        with self._lock:
            if handle.step in self._delivered:
                return
            self._delivered.add(handle.step)
            durable = self._durable.get(handle.step, False)
        self.promoter.committed(handle.step, promote=durable)
        if self.replicator is not None and self.local_store is not None:
            self.replicator.replicate(self.local_store, handle.step)  # to the peers, on its own thread

    def flush(self) -> None:
        """Hand every local commit seen so far to the promoter (a waiter may wake before a future's callbacks)."""
        with self._lock:
            tracked = list(self._tracked)
        for handle in tracked:
            if handle.committed.done():
                self._deliver(handle)

    def drain(self, timeout: float | None) -> bool:
        """Hand over the local commits, then wait for the promotions and replicas asked for; whether they ended in
        time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        promoted = self.promoter is None or self.promoter.drain(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return (self.replicator is None or self.replicator.drain(left)) and promoted

    def finish(self, engine: Any, timeout: float | None = None) -> bool:
        """At the end of training (or at an exception, bounded by ``timeout``): the local commits, then their
        promotions (errors queued in ``engine``); whether both ended in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        saved = engine.drain_quietly(timeout)
        return self.close(None if deadline is None else max(0.0, deadline - time.monotonic())) and saved

    def close(self, timeout: float | None) -> bool:
        """Finish the promotions and replicas (within ``timeout``) and stop their threads (the peers stop receiving)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        promoted = self.promoter is None or self.promoter.close(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return (self.replicator is None or self.replicator.close(left)) and promoted

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


def emergency_drain(engine: Any, tiers: Tiers | None, grace_s: float | None, step: int) -> None:
    """After the emergency cut at ``step``: the local commit, then its promotion, within ``grace_s``; the log says
    what landed where."""
    deadline = None if grace_s is None else time.monotonic() + grace_s

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    committed_in_time = engine.drain_quietly(left())
    where = f"committed step {engine.committed_step} to {engine.store.uri}"
    if not committed_in_time:
        where += f" (steps {engine.in_flight_steps()} still in flight after the grace period)"
    if tiers is not None:
        promoted_in_time = tiers.drain(left())
        where += f"; promoted step {tiers.promoted_step} to {tiers.promoter.target.uri if tiers.promoter else '?'}"
        if not promoted_in_time:
            where += " (a promotion was still running after the grace period)"
    _log.warning("emergency checkpoint at step %d: %s; training stops", step, where)


# -- resuming across tiers ---------------------------------------------------------------------------------
def latest_checkpoint(
    dirpath: str,
    storage_options: dict[str, Any] | None = None,
    *,
    local_dirpath: str | None = None,
    collective: bool = True,
) -> str | None:
    """Path of the newest committed, verified checkpoint of ``dirpath`` or, with ``local_dirpath``, of either tier.

    Without ``local_dirpath`` this is :func:`lightning_async_ckpt.lightning.resume.latest_checkpoint`. With it, the
    local tier's newest intact generation (every object re-read against its checksum) is returned when no
    generation of ``dirpath`` is newer (``dirpath`` is then only listed, never read); otherwise, or when the local
    tier is missing or damaged, the newest verified generation of ``dirpath``.

    Args:
        dirpath: The durable tier (the callback's ``dirpath``), a local folder or fsspec URL.
        storage_options: fsspec options for ``dirpath``.
        local_dirpath: The callback's ``local_dirpath``.
        collective: Without ``local_dirpath``, under a process group: rank 0 finds, every rank gets its answer
            (``False``: this rank looks alone). With ``local_dirpath`` every process answers for its own node-local
            tier and looks alone (a lookup on some ranks only must never wait for the others).

    Raises:
        StoreUnavailableError: ``dirpath`` cannot be listed.
    """
    if local_dirpath is None:
        return resume.latest_checkpoint(dirpath, storage_options, collective=collective)
    local = _newest_local(local_dirpath, resumable=False)
    if local is not None and not _durable_newer(dirpath, storage_options, local.step):
        return local.path
    durable = resume.latest_checkpoint(dirpath, storage_options, collective=False)
    return _pick(local, {durable} if durable else set(), single=True)


def find_last_across(callback: Any, trainer: Any) -> set[str]:
    """``ckpt_path="last"`` of a callback with ``local_dirpath``: :func:`latest_checkpoint`'s rule, resumable
    generations only (never ``save_weights_only`` ones). With ``replicas`` every rank agrees on one step, and a rank
    whose local tier lacks it gets it from a peer first (:mod:`~lightning_async_ckpt.lightning.replicas`)."""
    if writes_sharded(callback, trainer):  # DCP generations: every rank agrees (lightning/sharded_tiers.py)
        return find_last_sharded(callback, trainer)
    dirpath = resolve_dirpath(callback.dirpath, trainer.default_root_dir)
    if callback.tiers.replicas and trainer.world_size > 1:
        return _find_last_replicated(callback, trainer, dirpath)
    local = _agreed(trainer, _newest_local(callback.local_dirpath, resumable=True))
    durable = resume.find_last(callback, trainer)  # on every rank: a collective once the process group exists
    if local is not None and not _durable_newer(dirpath, callback.storage_options, local.step):
        _log.info("ckpt_path='last' resumes from the local tier: %s", local.path)
        return {local.path}
    return _pick(local, durable, single=False)


def _find_last_replicated(callback: Any, trainer: Any, dirpath: str) -> set[str]:
    local = _newest_local(callback.local_dirpath, resumable=True)
    listed = _durable_steps(dirpath, callback.storage_options)
    agreed = agree_on_local(
        callback.tiers,
        trainer,
        newest_local=None if local is None else (local.version, local.step),
        durable_step=max(listed, default=None),
        store_of=lambda version: CheckpointStore(version_uri(callback.local_dirpath, version), check_writable=False),
    )
    if agreed is None:
        _log.info("ckpt_path='last': every rank resumes from dirpath (no local generation newer on any rank)")
        return resume.find_last(callback, trainer)
    store = CheckpointStore(version_uri(callback.local_dirpath, agreed[0]), check_writable=False)
    path = loadable_path(store.manifest(agreed[1]), store)
    _log.info("ckpt_path='last' resumes from the local tier (agreed by every rank): %s", path)
    return {path}


def _agreed(trainer: Any, local: _Local | None) -> _Local | None:
    """Every rank must resume from the same generation, and Lightning resolves ``"last"`` on each rank before any
    collective exists. On one node the ranks read the same node-local folder, so they agree; across nodes only rank
    0's node holds the local generations (no peer replicas yet), so every rank resumes from ``dirpath`` together."""
    if local is not None and trainer.num_nodes > 1:
        _log.info("ckpt_path='last': %d nodes; resuming from dirpath, not from the node-local tier", trainer.num_nodes)
        return None
    return local


def _pick(local: _Local | None, durable: set[str], *, single: bool) -> Any:
    steps = [_step_of(p) for p in durable]
    newest = max((s for s in steps if s is not None), default=-1)
    if local is not None and local.step >= newest:
        return local.path if single else {local.path}
    if single:
        return next(iter(durable), None)
    return durable


def _step_of(path: str) -> int | None:
    found = _STEP_IN_PATH.findall(path)
    return int(found[-1]) if found else None


def _durable_newer(dirpath: str, storage_options: dict[str, Any] | None, step: int) -> bool:
    """Whether ``dirpath`` or a version of it has a generation folder newer than ``step`` (a listing, no reads)."""
    return any(s > step for s in _durable_steps(dirpath, storage_options))


def _durable_steps(dirpath: str, storage_options: dict[str, Any] | None) -> list[int]:
    """The steps of the generation folders of ``dirpath`` and its versions (a listing, no reads)."""
    root = CheckpointStore(dirpath, storage_options, check_writable=False)
    listing = list_steps(root)
    steps = list(listing.steps)
    for version in listing.versions:
        steps += list_steps(CheckpointStore(version_uri(dirpath, version), storage_options, check_writable=False)).steps
    return steps


def _newest_local(local_dirpath: str, *, resumable: bool) -> _Local | None:
    def accept(manifest: Any) -> bool:
        has_file = any(o.name == CHECKPOINT_NAME for o in manifest.objects)
        return has_file and not (resumable and weights_only(manifest))

    def skip(url: str, problems: tuple[str, ...]) -> None:
        message = f"skipping local generation {url}: {'; '.join(problems)}"
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=4)

    found = newest_intact(local_dirpath, None, accept=accept, on_skip=skip)
    if found is None:
        return None
    return _Local(found.info.step, loadable_path(found.manifest, found.store), found.version)
