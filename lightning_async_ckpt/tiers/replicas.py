"""Peer replicas of the local tier: committed local generations copied to other ranks' local tiers over a gloo group.

The writing rank hands each committed local generation to :meth:`Replicator.replicate`; the thread
``lightning_async_ckpt-replicate`` sends it to the target ranks (:func:`replica_targets`: other nodes first); each
target's thread ``lightning_async_ckpt-replica-recv-<src>`` commits it into its own local tier, objects checked
against the source manifest, the manifest last with ``extra["replica_of"]`` (``docs/tiers.md``, "Peer replicas").
The wire is :mod:`~lightning_async_ckpt.tiers.replica_wire`; the restart side, :func:`restore_from_peers`, is
:mod:`~lightning_async_ckpt.tiers.replica_restore` (re-exported here).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import NewestWins, emit, retain_quietly
from lightning_async_ckpt.tiers.replica_persist import wait_restored
from lightning_async_ckpt.tiers.replica_restore import folder_id, restore_from_peers
from lightning_async_ckpt.tiers.replica_wire import (
    REPLICA_OF_KEY,
    Kind,
    ReplicaError,
    Wire,
    receive_generation,
    send_generation,
    tier_folder,
)

__all__ = [
    "REPLICA_OF_KEY",
    "WRITERS",
    "ReplicaError",
    "Replicator",
    "folder_id",
    "open_replicator",
    "replica_plan",
    "replica_targets",
    "restore_from_peers",
]

_log = logging.getLogger("lightning_async_ckpt")

#: The ranks that write the local tier under the single-writer layout (plain loops, Lightning DDP, Accelerate).
WRITERS = (0,)


def replica_targets(
    rank: int, world_size: int, *, replicas: int, ranks_per_node: int, fix: str = "more nodes"
) -> list[int]:
    """The ranks replica ``1..replicas`` of ``rank`` go to: ``(rank + i * jump) % world_size``.

    ``jump`` is the number of ranks per node when there are several nodes (each replica on another node: the failure
    blast radius), else 1 (other ranks of the one node, useful when each rank has its own folder).

    Raises:
        ConfigError: ``replicas`` is not below ``world_size``, or more than the other nodes can hold (the message
            ends with the fix: fewer replicas, or ``fix``).
    """
    nodes = max(1, world_size // max(1, ranks_per_node))
    jump = ranks_per_node if nodes > 1 else 1
    limit = nodes - 1 if nodes > 1 else world_size - 1
    if not 1 <= replicas <= limit:
        raise ConfigError(
            f"replicas={replicas} needs {replicas} other {'nodes' if nodes > 1 else 'ranks'}: this run has {nodes} "
            f"node(s) of {ranks_per_node} rank(s) ({world_size} ranks), so at most {limit}: pass replicas=N with N "
            f"below that (or {fix})"
        )
    return [(rank + i * jump) % world_size for i in range(1, replicas + 1)]


def replica_plan(
    rank: int, world_size: int, *, replicas: int, ranks_per_node: int, writers: tuple[int, ...] = WRITERS
) -> tuple[list[int], list[int], list[int]]:
    """This rank's part in the single-writer layout: ``(targets, sources, every target)``: the ranks this rank's
    generations go to (it is a writer), the writers whose generations it receives, and all targets (for the log).

    Raises:
        ConfigError: As :func:`replica_targets`.
    """
    plan = {w: replica_targets(w, world_size, replicas=replicas, ranks_per_node=ranks_per_node) for w in writers}
    sources = [w for w in writers if rank in plan[w]]
    return plan.get(rank, []), sources, sorted({t for targets in plan.values() for t in targets})


def open_replicator(local_dirpath: str, *, timeout_s: float | None = None, **replicator: Any) -> tuple[Any, Replicator]:
    """On every rank (collective): two gloo groups apart from the training's (NCCL on GPUs), one for the restart side
    (whose messages must never reach the receiving threads) and one streaming the replicas, and this rank's
    :class:`Replicator` (``replicator``: its arguments) on the second, receiving already; (restart group,
    replicator)."""
    from datetime import timedelta

    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    group = dist.new_group(backend="gloo", **timeout)
    stream = dist.new_group(backend="gloo", **timeout)
    opened = Replicator(stream, local_dirpath, **replicator)
    opened.start_receiving()
    return group, opened


class Replicator(NewestWins):
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
        super().__init__()  # pending / in flight: (store, step)
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
        with self._cond:
            if self._closing:
                _log.warning("replica of step %d not sent: the replicator is closed (replicate() after close())", step)
                return
        if not self.targets:
            return
        with self._cond:
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
        """Wait until no replication is pending or in flight, and this process's generations restored from a peer
        are committed (:mod:`~lightning_async_ckpt.tiers.replica_persist`); whether that happened within
        ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        restored = wait_restored(timeout)
        return super().drain(None if deadline is None else max(0.0, deadline - time.monotonic())) and restored

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
        self._serve(lambda item: self._send(*item))
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
        emit(self.on_event, "replica", name, **fields)

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
            try:
                header = json.loads(payload)
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except ValueError as exc:  # answered, and the link lives on
                _log.warning("replica message from rank %d refused: %s", src, exc)
                wire.send(src, Kind.FAIL, f"{type(exc).__name__}: {exc}".encode())
                continue
            committed = receive_generation(wire, src, header, self.local_dirpath)
            if committed is not None:
                self.received.append(committed.step)
                # Retention of the replica's own run: other runs sharing this local tier keep every generation.
                store = CheckpointStore(tier_folder(self.local_dirpath, header["where"]), run_id=committed.run_id)
                retain_quietly(store, self.keep_last)


def _where(root: str, uri: str) -> str:
    """The version folder (``""`` or ``"v1"``, ...) of local store ``uri`` under the local tier ``root``."""
    root, uri = root.rstrip("/"), uri.rstrip("/")
    return uri[len(root) + 1 :] if uri.startswith(root + "/") else ""
