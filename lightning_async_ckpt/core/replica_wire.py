"""The wire of peer replicas: framed messages over gloo send/recv, and one generation sent or received through it.

One sender talks to one receiver, in order (``Kind``): ``GEN`` (JSON: step, version folder, manifest) -> ``HAVE`` |
``NEED`` | ``FAIL`` (``HAVE`` only after the held copy's bytes were re-read against the manifest: a damaged one is
received again into a new version folder, :mod:`~lightning_async_ckpt.core.replica_repair`); after ``NEED``, per
object ``DATA``* then ``EOF`` (``ABORT`` when the source failed its own checksum; the receiver then aborts and answers
``FAIL``) -> ``OK`` | ``FAIL``. ``STOP`` ends a receiver. The receiver
commits through its own store's writer (write-once objects checked against the source manifest, the manifest last,
with ``extra["replica_of"]``), so a replica cut off mid-copy is never listed as committed.
"""

from __future__ import annotations

import enum
import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from lightning_async_ckpt.core.replica_repair import Held, held_copy, repair_where
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.io import read_verified
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.promote import copy_objects
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["REPLICA_OF_KEY", "Kind", "ReplicaError", "Wire", "receive_generation", "send_generation", "version_uri"]

_log = logging.getLogger("lightning_async_ckpt")

#: The manifest ``extra`` key a replica records its source in (``{"rank": ..., "step": ...}``).
REPLICA_OF_KEY = "replica_of"
_CHUNK = 16 << 20


class Kind(enum.IntEnum):
    """The kind of one message on the wire."""

    GEN = 1
    HAVE = 2
    NEED = 3
    DATA = 4
    EOF = 5
    ABORT = 6
    OK = 7
    FAIL = 8
    STOP = 9


class ReplicaError(CheckpointError):
    """A generation could not be replicated to (or restored from) a peer; the receiving folder has no manifest."""


class Wire:
    """Framed messages over point-to-point gloo send/recv: a header ``(kind, length)``, then the payload bytes.

    Thread-safety: one thread per peer, direction and tag (messages to one peer stay in order).

    Args:
        group: The gloo process group (ranks are global ranks).
        tag: The point-to-point tag of every message: two conversations between the same two ranks at once (each
            rank sends its own generations to the other) each need their own.
    """

    def __init__(self, group: Any, *, tag: int = 0) -> None:
        self.group = group
        self.tag = tag

    def send(self, dst: int, kind: int, payload: bytes | bytearray = b"") -> None:
        """Send one message of ``kind`` to rank ``dst`` (blocks until the peer takes it)."""
        dist.send(torch.tensor([kind, len(payload)], dtype=torch.int64), dst, group=self.group, tag=self.tag)
        if payload:
            data = payload if isinstance(payload, bytearray) else bytearray(payload)  # torch wants a writable buffer
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dst, group=self.group, tag=self.tag)

    def recv(self, src: int) -> tuple[int, Any]:
        """The next message from rank ``src``: its kind and payload (``bytes``; a ``memoryview`` over the received
        buffer for ``DATA``, not copied again)."""
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src, group=self.group, tag=self.tag)
        kind, length = int(header[0]), int(header[1])
        if not length:
            return kind, b""
        payload = torch.empty(length, dtype=torch.uint8)
        dist.recv(payload, src, group=self.group, tag=self.tag)
        return kind, (payload.numpy().data if kind == Kind.DATA else payload.numpy().tobytes())


class _Sink:
    """A write-only stream that sends what it gets as ``DATA`` chunks (one copy into the chunk buffer)."""

    def __init__(self, wire: Wire, dst: int) -> None:
        self.wire, self.dst, self.buffer = wire, dst, bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.buffer += view
        while len(self.buffer) >= _CHUNK:
            chunk = self.buffer[:_CHUNK]
            del self.buffer[:_CHUNK]
            self.wire.send(self.dst, Kind.DATA, chunk)
        return view.nbytes

    def flush(self) -> None:
        if self.buffer:
            self.wire.send(self.dst, Kind.DATA, self.buffer)
            self.buffer = bytearray()


def version_uri(root: str, where: str) -> str:
    return f"{root.rstrip('/')}/{where}" if where else root


def send_generation(wire: Wire, store: CheckpointStore, step: int, where: str, dst: int) -> bool:
    """Send committed generation ``step`` of ``store`` (version folder ``where`` of the local tier) to ``dst``;
    whether bytes were sent (``False``: ``dst``'s folder held it already).

    Raises:
        ReplicaError: ``dst`` could not commit it (it holds no manifest for it).
    """
    manifest = store.manifest(step)
    header = {"step": step, "where": where, "manifest": manifest.to_json().decode()}
    wire.send(dst, Kind.GEN, json.dumps(header).encode())
    kind, payload = wire.recv(dst)
    if kind == Kind.HAVE:
        return False
    if kind != Kind.NEED:
        raise ReplicaError(f"rank {dst} refused step {step}: {payload.decode(errors='replace')}")
    for obj in manifest.objects:
        sink = _Sink(wire, dst)
        try:
            read_verified(store.fs, f"{store.generation_path(step)}/{obj.key}", obj, into=sink)
            sink.flush()
        except Exception as exc:
            wire.send(dst, Kind.ABORT, f"{type(exc).__name__}: {exc}".encode())
            wire.recv(dst)  # the receiver's FAIL: it aborted its writer (no manifest)
            raise ReplicaError(f"step {step} of {store.uri} could not be read for rank {dst}: {exc}") from exc
        wire.send(dst, Kind.EOF)
    kind, payload = wire.recv(dst)
    if kind != Kind.OK:
        raise ReplicaError(f"rank {dst} could not commit step {step}: {payload.decode(errors='replace')}")
    return True


def receive_generation(
    wire: Wire, src: int, header: dict[str, Any], root: str, *, where: str | None = None
) -> Manifest | None:
    """Answer one ``GEN`` from ``src``: commit the generation in local folder ``root`` (its version folder, or
    ``where``), manifest last; the manifest committed, or ``None`` when the folder held it intact already or it
    failed (``src`` is told). A damaged committed copy there is left as it is and the generation is committed again
    into a new version folder (:func:`~lightning_async_ckpt.core.replica_repair.repair_where`)."""
    manifest = Manifest.from_json(header["manifest"], where=f"replica from rank {src}")
    relative = header["where"] if where is None else where
    store = CheckpointStore(version_uri(root, relative), run_id=manifest.run_id)
    step = manifest.step
    held, why = held_copy(store, manifest)  # an intact copy: every byte re-read, not only the manifest compared
    if held is Held.OTHER:
        wire.send(src, Kind.FAIL, why.encode())
        return None
    if held is Held.DAMAGED:  # committed names are never rewritten: the fresh copy goes to a new version folder
        fresh, have = repair_where(root, relative, manifest)
        _log.warning(
            "replica of step %d from rank %d in %s is damaged (%s): %s %s",
            step,
            src,
            store.uri,
            why,
            "an intact copy is in" if have else "a fresh copy goes to",
            version_uri(root, fresh),
        )
        held = Held.INTACT if have else Held.NONE
        store = CheckpointStore(version_uri(root, fresh), run_id=manifest.run_id)
    if held is Held.INTACT:
        wire.send(src, Kind.HAVE)
        return None
    try:
        writer = store.begin(step)
    except Exception as exc:  # noqa: BLE001 - told to the sender, which raises it
        wire.send(src, Kind.FAIL, f"{type(exc).__name__}: {exc}".encode())
        return None
    wire.send(src, Kind.NEED)
    failure: list[BaseException] = []

    def read_into(obj: Any, stream: Any) -> None:
        # Every DATA message is consumed even after a local write failed, so the sender's stream stays in step.
        while True:
            kind, payload = wire.recv(src)
            if kind == Kind.EOF:
                break
            if kind == Kind.ABORT:
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
        wire.send(src, Kind.FAIL, f"{type(exc).__name__}: {exc}".encode())
        _log.warning("replica of step %d from rank %d not committed in %s: %s", step, src, store.uri, exc)
        return None
    wire.send(src, Kind.OK)
    return committed


def _drain_objects(wire: Wire, src: int, manifest: Manifest, done: int) -> None:
    for _ in manifest.objects[done:]:
        while wire.recv(src)[0] not in (Kind.EOF, Kind.ABORT):
            pass
