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

Wire protocol (one sender to one receiver, in order): ``GEN`` (JSON: step, version folder, manifest) -> ``HAVE`` |
``NEED`` | ``FAIL``; after ``NEED``, per object ``DATA``* then ``EOF`` (``ABORT`` when the source failed its own
checksum) -> ``OK`` | ``FAIL``. ``STOP`` ends a receiver.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_async_ckpt.errors import CheckpointError, ManifestError
from lightning_async_ckpt.storage.io import read_verified
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.promote import copy_objects
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "REPLICA_OF_KEY",
    "ReplicaError",
    "Replicator",
    "folder_id",
    "replica_targets",
    "restore_from_peers",
]

_log = logging.getLogger("lightning_async_ckpt")

#: The manifest ``extra`` key a replica records its source in (``{"rank": ..., "step": ...}``).
REPLICA_OF_KEY = "replica_of"
_GEN, _HAVE, _NEED, _DATA, _EOF, _ABORT, _OK, _FAIL, _STOP = range(1, 10)
_CHUNK = 16 << 20
_ID_FILE = ".tier-id"


class ReplicaError(CheckpointError):
    """A generation could not be replicated to (or restored from) a peer; the receiving folder has no manifest."""


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


class _Wire:
    """Framed messages over point-to-point gloo send/recv: a header ``(kind, length)``, then the payload bytes."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, dst: int, kind: int, payload: bytes = b"") -> None:
        dist.send(torch.tensor([kind, len(payload)], dtype=torch.int64), dst, group=self.group)
        if payload:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group=self.group)

    def recv(self, src: int) -> tuple[int, bytes]:
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src, group=self.group)
        kind, length = int(header[0]), int(header[1])
        if not length:
            return kind, b""
        payload = torch.empty(length, dtype=torch.uint8)
        dist.recv(payload, src, group=self.group)
        return kind, payload.numpy().tobytes()


class _Sink:
    """A write-only stream that sends what it gets as ``DATA`` chunks."""

    def __init__(self, wire: _Wire, dst: int) -> None:
        self.wire, self.dst, self.buffer = wire, dst, bytearray()

    def write(self, data: Any) -> int:
        self.buffer += bytes(data)
        while len(self.buffer) >= _CHUNK:
            self.wire.send(self.dst, _DATA, bytes(self.buffer[:_CHUNK]))
            del self.buffer[:_CHUNK]
        return len(data)

    def flush(self) -> None:
        if self.buffer:
            self.wire.send(self.dst, _DATA, bytes(self.buffer))
            self.buffer.clear()


def _version_uri(root: str, where: str) -> str:
    return f"{root.rstrip('/')}/{where}" if where else root


def send_generation(wire: _Wire, store: CheckpointStore, step: int, where: str, dst: int) -> bool:
    """Send committed generation ``step`` of ``store`` (version folder ``where`` of the local tier) to ``dst``;
    whether bytes were sent (``False``: ``dst``'s folder held it already).

    Raises:
        ReplicaError: ``dst`` could not commit it (it holds no manifest for it).
    """
    manifest = store.manifest(step)
    header = {"step": step, "where": where, "manifest": manifest.to_json().decode()}
    wire.send(dst, _GEN, json.dumps(header).encode())
    kind, payload = wire.recv(dst)
    if kind == _HAVE:
        return False
    if kind != _NEED:
        raise ReplicaError(f"rank {dst} refused step {step}: {payload.decode(errors='replace')}")
    for obj in manifest.objects:
        sink = _Sink(wire, dst)
        try:
            read_verified(store.fs, f"{store.generation_path(step)}/{obj.key}", obj, into=sink)
            sink.flush()
        except Exception as exc:
            wire.send(dst, _ABORT, f"{type(exc).__name__}: {exc}".encode())
            wire.recv(dst)  # the receiver's FAIL: it aborted its writer (no manifest)
            raise ReplicaError(f"step {step} of {store.uri} could not be read for rank {dst}: {exc}") from exc
        wire.send(dst, _EOF)
    kind, payload = wire.recv(dst)
    if kind != _OK:
        raise ReplicaError(f"rank {dst} could not commit step {step}: {payload.decode(errors='replace')}")
    return True


def receive_generation(wire: _Wire, src: int, header: dict[str, Any], root: str) -> Manifest | None:
    """Answer one ``GEN`` from ``src``: commit the generation in local folder ``root`` (its version folder), manifest
    last; the manifest committed, or ``None`` when the folder held it already or it failed (``src`` is told)."""
    manifest = Manifest.from_json(header["manifest"], where=f"replica from rank {src}")
    store = CheckpointStore(_version_uri(root, header["where"]), run_id=manifest.run_id)
    step = manifest.step
    try:
        existing = store.manifest(step)
    except (ManifestError, FileNotFoundError):
        existing = None
    if existing is not None:
        same = [(o.name, o.size, o.checksum) for o in existing.objects] == [
            (o.name, o.size, o.checksum) for o in manifest.objects
        ]
        wire.send(src, _HAVE if same else _FAIL, b"" if same else f"{store.uri} holds another step {step}".encode())
        return None
    try:
        writer = store.begin(step)
    except Exception as exc:  # noqa: BLE001 - told to the sender, which raises it
        wire.send(src, _FAIL, f"{type(exc).__name__}: {exc}".encode())
        return None
    wire.send(src, _NEED)
    failure: list[BaseException] = []

    def read_into(obj: Any, stream: Any) -> None:
        # Every DATA message is consumed even after a local write failed, so the sender's stream stays in step.
        while True:
            kind, payload = wire.recv(src)
            if kind == _EOF:
                break
            if kind == _ABORT:
                failure.append(ReplicaError(f"rank {src} aborted: {payload.decode(errors='replace')}"))
                break
            if not failure:
                try:
                    stream.write(payload)
                except Exception as exc:  # noqa: BLE001 - reported after the object's last message
                    failure.append(exc)
        if failure:
            raise failure[0]

    try:
        copy_objects(writer, manifest, read_into)
        extra = {**manifest.extra, REPLICA_OF_KEY: {"rank": src, "step": step}}
        committed = writer.commit(cut=manifest.cut, plan=manifest.plan, timings=manifest.timings, extra=extra)
    except Exception as exc:  # noqa: BLE001 - told to the sender; nothing is committed here
        writer.abort()
        if not failure:  # copy_objects stopped early: consume the rest so the sender reaches its last recv
            _drain_objects(wire, src, manifest, done=len(writer.objects))
        wire.send(src, _FAIL, f"{type(exc).__name__}: {exc}".encode())
        _log.warning("replica of step %d from rank %d not committed in %s: %s", step, src, store.uri, exc)
        return None
    wire.send(src, _OK)
    return committed


def _drain_objects(wire: _Wire, src: int, manifest: Manifest, done: int) -> None:
    for _ in manifest.objects[done:]:
        while wire.recv(src)[0] not in (_EOF, _ABORT):
            pass


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
    ) -> None:
        self.wire = _Wire(group)
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
        self._receivers: list[threading.Thread] = []

    def start_receiving(self) -> None:
        """Start one receiving thread per source (each ends at the source's ``STOP`` or when the link breaks)."""
        self._receivers = [t for t in self._receivers if t.is_alive()]
        if self._receivers:
            return
        for src in self.sources:
            thread = threading.Thread(
                target=self._receive_loop, args=(src,), name=f"lightning_async_ckpt-replica-recv-{src}", daemon=True
            )
            thread.start()
            self._receivers.append(thread)

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
        for thread in self._receivers:
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
                self.wire.send(dst, _STOP)
            except Exception:  # noqa: BLE001 - a target that is gone needs no stop
                _log.debug("rank %d did not take the stop message", dst, exc_info=True)

    def _send(self, store: CheckpointStore, step: int) -> None:
        where = _where(self.local_dirpath, store.uri)
        for dst in self.targets:
            try:
                if send_generation(self.wire, store, step, where, dst):
                    self.copied.setdefault(step, []).append(dst)
                self.replicated.setdefault(step, []).append(dst)
                _log.info("step %d replicated to rank %d", step, dst)
            except BaseException as exc:  # noqa: BLE001 - handed to on_error, raised on the training thread
                _log.warning("replica of step %d to rank %d failed: %s", step, dst, exc)
                if self.on_error is not None:
                    self.on_error(exc)

    def _receive_loop(self, src: int) -> None:
        while True:
            try:
                kind, payload = self.wire.recv(src)
            except Exception as exc:  # noqa: BLE001 - the source is gone (its process ended): nothing more comes
                _log.info("replicas from rank %d end: %s", src, exc)
                return
            if kind == _STOP:
                return
            if kind != _GEN:
                _log.warning("replica link from rank %d out of step (message %d): closing it", src, kind)
                return
            committed = receive_generation(self.wire, src, json.loads(payload), self.local_dirpath)
            if committed is not None:
                self.received.append(committed.step)
                self._retain(CheckpointStore(_version_uri(self.local_dirpath, json.loads(payload)["where"])))

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
        every rank resumes from the durable tier (it is newer, or no rank holds a local generation).

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
    wire, failure = _Wire(group), None
    for i, needer in enumerate(needers):
        source = holders[i % len(holders)]
        try:
            if rank == source:
                send_generation(wire, newest_store(agreed[0]), agreed[1], _version_name(agreed[0]), needer)
                _log.info("restored step %d to rank %d's local tier from this rank", agreed[1], needer)
            elif rank == needer:
                kind, payload = wire.recv(source)
                committed = (
                    None if kind != _GEN else receive_generation(wire, source, json.loads(payload), local_dirpath)
                )
                if committed is None:
                    raise ReplicaError(f"step {agreed[1]} could not be restored from rank {source}")
                _log.warning("local tier lost step %d: restored from rank %d's replica", agreed[1], source)
        except Exception as exc:  # noqa: BLE001 - agreed below
            failure = exc
    failed: list[Any] = [None] * world
    dist.all_gather_object(failed, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    problems = [f"rank {r}: {p}" for r, p in enumerate(failed) if p]
    if problems:
        raise ReplicaError("restoring the local tier from peers failed: " + "; ".join(problems))
    return agreed


def _version_name(version: int) -> str:
    return f"v{version}" if version else ""
