"""Peer replicas of the local tier: committed local generations copied to other ranks' local tiers over a gloo group.

The writing rank hands each generation committed in its local tier to :meth:`Replicator.replicate`; the thread
``lightning_async_ckpt-replicate`` sends it to the target ranks (:func:`replica_targets`: other nodes first) over a
separate gloo process group, never on the training thread. Each target's thread
``lightning_async_ckpt-replica-recv-<src>`` writes it into its own local tier through a
:class:`~lightning_async_ckpt.storage.writer.GenerationWriter` (objects under write-once names, each checked against
the source manifest's size and checksum, the manifest last, with ``extra["replica_of"]``): a half-copied replica has
no manifest and is never listed as committed. Only the receiving rank writes its folder, so this works when each
rank's folder is visible to that rank alone; a target whose folder already holds the generation (a folder shared by
the ranks of a node) answers "have it" and nothing is sent.

:func:`restore_from_peers` is the restart side, collective over the group: every rank reports the newest intact
generation of its local tier, the ranks agree on the newest one any rank holds (unless the durable tier is newer),
and each folder that lacks it receives it from a rank that holds it. Every rank then loads the same step.

The messages and one generation's transfer are in :mod:`~lightning_async_ckpt.core.replica_wire`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_async_ckpt.core.replica_wire import (
    REPLICA_OF_KEY,
    Kind,
    ReplicaError,
    Wire,
    receive_generation,
    send_generation,
    version_uri,
)
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "REPLICA_OF_KEY",
    "ReplicaError",
    "Replicator",
    "folder_id",
    "replica_plan",
    "replica_targets",
    "restore_from_peers",
]

_log = logging.getLogger("lightning_async_ckpt")
_ID_FILE = ".tier-id"


def replica_targets(rank: int, world_size: int, *, replicas: int, ranks_per_node: int) -> list[int]:
    """The ranks replica ``1..replicas`` of ``rank`` go to: ``(rank + i * jump) % world_size``.

    ``jump`` is the number of ranks per node when there are several nodes (each replica on another node: the failure
    blast radius), else 1 (other ranks of the one node, useful when each rank has its own folder).

    Raises:
        ValueError: ``replicas`` is not below ``world_size``, or more than the other nodes can hold.
    """
    nodes = max(1, world_size // max(1, ranks_per_node))
    jump = ranks_per_node if nodes > 1 else 1
    limit = nodes - 1 if nodes > 1 else world_size - 1
    if not 1 <= replicas <= limit:
        raise ValueError(
            f"replicas={replicas} needs {replicas} other {'nodes' if nodes > 1 else 'ranks'}: this run has {nodes} "
            f"node(s) of {ranks_per_node} rank(s) ({world_size} ranks), so at most {limit}"
        )
    return [(rank + i * jump) % world_size for i in range(1, replicas + 1)]


def replica_plan(
    rank: int, world_size: int, *, replicas: int, ranks_per_node: int, writers: tuple[int, ...] = (0,)
) -> tuple[list[int], list[int], list[int]]:
    """This rank's part in the single-writer layout: ``(targets, sources, every target)``: the ranks this rank's
    generations go to (it is a writer), the writers whose generations it receives, and all targets (for the log).

    Raises:
        ValueError: As :func:`replica_targets`.
    """
    plan = {w: replica_targets(w, world_size, replicas=replicas, ranks_per_node=ranks_per_node) for w in writers}
    sources = [w for w in writers if rank in plan[w]]
    return plan.get(rank, []), sources, sorted({t for targets in plan.values() for t in targets})


def folder_id(root: str) -> str:
    """A random id stored in local folder ``root`` (created once, exclusively): ranks that share a folder see one id."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, _ID_FILE)
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(uuid.uuid4().hex)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # exclusive and atomic: the first rank's id wins, never a half-written one
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()


class Replicator:
    """Replicates committed generations of this rank's local tier to ``targets`` and receives from ``sources``.

    Thread-safety: :meth:`replicate` may be called from any thread (the engine's upload thread calls it after a
    local commit); the sends run on ``lightning_async_ckpt-replicate``, at most one generation in flight and the
    newest pending (a newer one replaces a pending one). Receives run on one thread per source.

    Args:
        group: A gloo process group holding every rank (:func:`torch.distributed.new_group`).
        local_dirpath: This rank's local tier (replicas land in the same version folder as their source).
        targets: Ranks this rank's generations go to.
        sources: Ranks whose generations this rank receives.
        keep_last: Retention of this rank's local tier after each replica committed (``None``: keep all).
        on_error: Receives each failed replication (on the sending thread).
        on_event: Called with an event name and fields (an ``EventLog.emit``): ``replicated`` (``step``,
            ``target``, ``copied``: whether bytes were sent, ``replicate_s``), ``replica_failed`` (``step``,
            ``target``, ``error``).
        where: Maps a replicated store's URI to the folder, relative to a target's local tier, its replica goes to
            (default: the same version folder as the source).
    """

    def __init__(
        self,
        group: Any,
        local_dirpath: str,
        *,
        targets: list[int],
        sources: list[int],
        keep_last: int | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        on_event: Callable[..., None] | None = None,
        where: Callable[[str], str] | None = None,
    ) -> None:
        self.on_event, self.where = on_event, where
        self.wire = Wire(group, tag=dist.get_rank() + 1)  # one tag per sending rank: ranks may send both ways
        self.local_dirpath = local_dirpath
        self.targets, self.sources = list(targets), list(sources)
        self.keep_last = keep_last
        self.on_error = on_error
        self.replicated: dict[int, list[int]] = {}  # step -> ranks that committed it (or held it already)
        self.copied: dict[int, list[int]] = {}  # step -> ranks its bytes were sent to
        self.received: list[int] = []
        self._cond = threading.Condition()
        self._pending: tuple[CheckpointStore, int] | None = None
        self._busy = False
        self._closing = False
        self._sender: threading.Thread | None = None
        self._receivers: dict[int, threading.Thread] = {}
        self._stopped: set[int] = set()  # sources whose stop message was taken (their thread is ending)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed replicator replicates nothing more)."""
        with self._cond:
            return self._closing

    def start_receiving(self) -> None:
        """Start one receiving thread per source that has none (each ends at its source's ``STOP``, acknowledged, or
        when the link breaks); a thread that took its stop message is joined and replaced (the next fit)."""
        for src in self.sources:
            thread = self._receivers.get(src)
            with self._cond:
                stopped = src in self._stopped
                self._stopped.discard(src)
            if thread is not None and stopped:
                thread.join()  # it acknowledged the stop: it is returning
            elif thread is not None and thread.is_alive():
                continue
            thread = threading.Thread(
                target=self._receive_loop, args=(src,), name=f"lightning_async_ckpt-replica-recv-{src}", daemon=True
            )
            thread.start()
            self._receivers[src] = thread

    def replicate(self, store: CheckpointStore, step: int) -> None:
        """Send committed generation ``step`` of ``store`` (this rank's local tier) to every target, in the
        background."""
        if not self.targets:
            return
        with self._cond:
            if self._closing:
                return
            if self._pending is not None and self._pending[1] < step:
                _log.info("replica of step %d skipped: step %d is newer", self._pending[1], step)
            if self._pending is None or self._pending[1] < step:
                self._pending = (store, step)
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_loop, name="lightning_async_ckpt-replicate", daemon=True
                )
                self._sender.start()
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no replication is pending or in flight; whether that happened within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the replications asked for, tell every target to stop receiving, join the threads."""
        finished = self.drain(timeout)
        with self._cond:
            self._closing = True
            self._pending = None
            if self._sender is None and self.targets:  # never sent: the targets still wait for the stop message
                self._sender = threading.Thread(
                    target=self._send_loop, name="lightning_async_ckpt-replicate", daemon=True
                )
                self._sender.start()
            self._cond.notify_all()
        if self._sender is not None:
            self._sender.join(timeout)
        for thread in self._receivers.values():
            thread.join(timeout)
        return finished

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    break
                (store, step), self._pending = self._pending, None
                self._busy = True
            try:
                self._send(store, step)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        for dst in self.targets:
            try:
                self.wire.send(dst, Kind.STOP)
                self.wire.recv(dst)  # its acknowledgement: the target's receiver is ending (a next fit restarts it)
            except Exception:  # noqa: BLE001 - a target that is gone needs no stop
                _log.debug("rank %d did not take the stop message", dst, exc_info=True)

    def _send(self, store: CheckpointStore, step: int) -> None:
        where = self.where(store.uri) if self.where is not None else _where(self.local_dirpath, store.uri)
        for dst in self.targets:
            started = time.monotonic()
            try:
                copied = send_generation(self.wire, store, step, where, dst)
            except BaseException as exc:  # noqa: BLE001 - handed to on_error, raised on the training thread
                _log.warning("replica of step %d to rank %d failed: %s", step, dst, exc)
                self._event("replica_failed", step=step, target=dst, error=f"{type(exc).__name__}: {exc}")
                if self.on_error is not None:
                    self.on_error(exc)
                continue
            if copied:
                self.copied.setdefault(step, []).append(dst)
            self.replicated.setdefault(step, []).append(dst)
            _log.info("step %d replicated to rank %d", step, dst)
            self._event("replicated", step=step, target=dst, copied=copied, replicate_s=time.monotonic() - started)

    def _event(self, name: str, **fields: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(name, **fields)
            except Exception:  # noqa: BLE001 - telemetry never fails a replica
                _log.debug("replica event %s not recorded", name, exc_info=True)

    def _receive_loop(self, src: int) -> None:
        wire = Wire(self.wire.group, tag=src + 1)  # the source's conversation, apart from this rank's own sends
        while True:
            try:
                kind, payload = wire.recv(src)
            except Exception as exc:  # noqa: BLE001 - the source is gone (its process ended): nothing more comes
                _log.info("replicas from rank %d end: %s", src, exc)
                return
            if kind == Kind.STOP:
                with self._cond:
                    self._stopped.add(src)
                wire.send(src, Kind.OK)
                return
            if kind != Kind.GEN:
                _log.warning("replica link from rank %d out of step (message %d): closing it", src, kind)
                return
            committed = receive_generation(wire, src, json.loads(payload), self.local_dirpath)
            if committed is not None:
                self.received.append(committed.step)
                self._retain(CheckpointStore(version_uri(self.local_dirpath, json.loads(payload)["where"])))

    def _retain(self, store: CheckpointStore) -> None:
        if self.keep_last is None:
            return
        try:
            store.retain(self.keep_last, verify=False, all_runs=True)
        except Exception:  # noqa: BLE001 - retention never fails a replica
            _log.warning("retention of %s failed", store.uri, exc_info=True)


def _where(root: str, uri: str) -> str:
    """The version folder (``""`` or ``"v1"``, ...) of local store ``uri`` under the local tier ``root``."""
    root, uri = root.rstrip("/"), uri.rstrip("/")
    return uri[len(root) + 1 :] if uri.startswith(root + "/") else ""


def restore_from_peers(
    group: Any,
    local_dirpath: str,
    *,
    newest_local: tuple[int, int] | None,
    durable_step: int | None,
    newest_store: Callable[[int], CheckpointStore],
) -> tuple[int, int] | None:
    """Collective over ``group`` (every rank calls it): agree on the generation every rank resumes from, and copy
    it into each local folder that lacks it from a rank that holds it.

    Args:
        group: The replicas' gloo group (every rank).
        local_dirpath: This rank's local tier.
        newest_local: ``(version, step)`` of the newest intact generation of this rank's local tier, or ``None``.
        durable_step: The newest step this rank sees listed in the durable tier, or ``None``.
        newest_store: The local store of a version folder (``0``: ``local_dirpath`` itself).

    Returns:
        ``(version, step)`` of the agreed local generation, now committed in this rank's folder, or ``None`` when
        every rank resumes from the durable tier (it is newer, or no rank holds a local generation). The version is
        this folder's: a folder holding a damaged copy of the agreed generation (committed, so never overwritten)
        receives it into a new version folder.

    Raises:
        ReplicaError: A copy failed (on the ranks that sent or received it; the others see the barrier fail).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = {"local": newest_local, "durable": durable_step, "folder": folder_id(local_dirpath)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    held = [tuple(e["local"]) for e in everyone if e["local"] is not None]
    durable = max((e["durable"] for e in everyone if e["durable"] is not None), default=None)
    if not held:
        return None
    agreed = max(held, key=lambda vs: (vs[1], vs[0]))
    if durable is not None and durable > agreed[1]:
        return None
    holders = [r for r, e in enumerate(everyone) if e["local"] is not None and tuple(e["local"]) == agreed]
    have = {everyone[r]["folder"] for r in holders}
    needers: list[int] = []
    for r, e in enumerate(everyone):
        if e["folder"] not in have:
            have.add(e["folder"])  # one receiving rank per folder; the ranks sharing it see its copy
            needers.append(r)
    wire, failure, here = Wire(group), None, agreed[0]
    for i, needer in enumerate(needers):
        source = holders[i % len(holders)]
        try:
            if rank == source:
                send_generation(wire, newest_store(agreed[0]), agreed[1], _version_name(agreed[0]), needer)
                _log.info("restored step %d to rank %d's local tier from this rank", agreed[1], needer)
            elif rank == needer:
                here = _free_version(local_dirpath, newest_store(agreed[0]), agreed)
                kind, payload = wire.recv(source)
                header = json.loads(payload) if kind == Kind.GEN else None
                where = _version_name(here)
                committed = (
                    None if header is None else receive_generation(wire, source, header, local_dirpath, where=where)
                )
                if committed is None:
                    raise ReplicaError(f"step {agreed[1]} could not be restored from rank {source}")
                _log.warning("local tier lost step %d: restored from rank %d's replica", agreed[1], source)
        except Exception as exc:  # noqa: BLE001 - agreed below
            failure = exc
    outcome: list[Any] = [None] * world
    problem = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(outcome, (problem, here), group=group)
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(outcome) if p]
    if problems:
        raise ReplicaError("restoring the local tier from peers failed: " + "; ".join(problems))
    # The ranks sharing a needer's folder take the version it received into.
    mine_folder = everyone[rank]["folder"]
    receiver = next((n for n in needers if everyone[n]["folder"] == mine_folder), None)
    return (outcome[receiver][1] if receiver is not None else agreed[0]), agreed[1]


def _free_version(local_dirpath: str, store: CheckpointStore, agreed: tuple[int, int]) -> int:
    """Where this folder receives the agreed generation: its own version, unless that holds a committed copy of it
    (damaged, or this rank would hold it intact): then a new version folder (committed names are never overwritten)."""
    try:
        store.manifest(agreed[1])
    except Exception:  # noqa: BLE001 - not committed there (missing, leftover, rejected): receive it there
        return agreed[0]
    root = CheckpointStore(local_dirpath, check_writable=False)
    return max([agreed[0], *version_folders(root.fs, root.root)]) + 1


def _version_name(version: int) -> str:
    return f"v{version}" if version else ""
