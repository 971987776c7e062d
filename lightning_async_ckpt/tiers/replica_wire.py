"""The wire of peer replicas: framed messages over gloo send/recv, and one generation sent or received through it.

One sender talks to one receiver, in order (``Kind``): ``GEN`` (JSON: step, version folder, manifest) -> ``HAVE`` |
``NEED`` | ``FAIL`` (``HAVE`` only after the held copy's bytes were re-read against the manifest: a damaged one is
received again into a new version folder, :mod:`~lightning_async_ckpt.tiers.replica_repair`); after ``NEED``, per
object ``DATA``* then ``EOF`` (``ABORT`` when the source failed its own checksum; the receiver then aborts and answers
``FAIL``) -> ``OK`` | ``FAIL``. ``STOP`` ends a receiver. The receiver
commits through its own store's writer (write-once objects checked against the source manifest, the manifest last,
with ``extra["replica_of"]``), so a replica cut off mid-copy is never listed as committed.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import queue
import re
import threading
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from fsspec.core import split_protocol

from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.io import READ_CHUNK, read_verified
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.promote import copy_objects
from lightning_async_ckpt.tiers.replica_persist import DeferredSync, commit_in_background
from lightning_async_ckpt.tiers.replica_repair import Held, held_copy, repair_where

__all__ = [
    "REPLICA_OF_KEY",
    "Kind",
    "ReplicaError",
    "Wire",
    "receive_from",
    "receive_generation",
    "send_generation",
    "tier_folder",
    "version_uri",
]

_log = logging.getLogger("lightning_async_ckpt")

#: The manifest ``extra`` key a replica records its source in (``{"rank": ..., "step": ...}``).
REPLICA_OF_KEY = "replica_of"
#: The folders of a local tier a replica goes to: ``""``, a version folder ``v<k>``, a layout's folder of ranks
#: (``rank-<r>``, ``replica-of-rank-<r>``) or one of those in a version folder.
_TIER_FOLDER_RE = re.compile(r"^(?:v[1-9][0-9]{0,5}(?:/(?:replica-of-)?rank-[0-9]+)?|(?:replica-of-)?rank-[0-9]+)?$")
_CHUNK = READ_CHUNK  # the largest DATA message: one chunk of the sender's reads


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
        self._data: torch.Tensor | None = None  # the reused buffer DATA payloads are received into
        self._spare: list[torch.Tensor] = []  # the write-behind buffers of a receiver (:class:`_WriteBehind`)

    def send(self, dst: int, kind: int, payload: bytes | bytearray | memoryview = b"") -> None:
        """Send one message of ``kind`` to rank ``dst`` (blocks until the peer takes it). A writable payload (a
        ``bytearray`` or a view of one) is sent without a copy."""
        view = memoryview(payload).cast("B")
        dist.send(torch.tensor([kind, view.nbytes], dtype=torch.int64), dst, group=self.group, tag=self.tag)
        if view.nbytes:
            data = bytearray(view) if view.readonly else view  # torch wants a writable buffer
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dst, group=self.group, tag=self.tag)

    def recv(self, src: int, into: torch.Tensor | None = None) -> tuple[int, Any]:
        """The next message from rank ``src``: its kind and payload (``bytes``; for ``DATA`` a ``memoryview`` of
        ``into`` when it is large enough (else of a new buffer), or without ``into`` of a buffer this wire reuses:
        valid until its next :meth:`recv`)."""
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src, group=self.group, tag=self.tag)
        kind, length = int(header[0]), int(header[1])
        if not length:
            return kind, b""
        if kind != Kind.DATA:
            payload = torch.empty(length, dtype=torch.uint8)
            dist.recv(payload, src, group=self.group, tag=self.tag)
            return kind, payload.numpy().tobytes()
        if into is None:
            if self._data is None or self._data.numel() < length:  # a fresh buffer per chunk faulted every page
                self._data = torch.empty(max(length, _CHUNK), dtype=torch.uint8)
            into = self._data
        elif into.numel() < length:  # longer than the caller's buffer: a buffer of its own (never the shared one)
            into = torch.empty(length, dtype=torch.uint8)
        payload = into[:length]
        dist.recv(payload, src, group=self.group, tag=self.tag)
        return kind, payload.numpy().data

    def buffers(self, n: int) -> list[torch.Tensor]:
        """``n`` receive buffers of one chunk each, kept by this wire for its next calls."""
        while len(self._spare) < n:
            self._spare.append(torch.empty(_CHUNK, dtype=torch.uint8))
        return self._spare[:n]


class _Sink:
    """A write-only stream that sends each chunk it gets as one ``DATA`` message, without copying it (the reader's
    chunks are :data:`~lightning_async_ckpt.storage.io.READ_CHUNK` views of its reused buffer)."""

    def __init__(self, wire: Wire, dst: int) -> None:
        self.wire, self.dst = wire, dst

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes:
            self.wire.send(self.dst, Kind.DATA, view)
        return view.nbytes


class _WriteBehind:
    """Writes received chunks to ``stream`` on a thread of its own while the next chunk is received into another
    buffer (the network copy and the local write overlap instead of taking turns). A write error is kept in
    :attr:`failure`; later chunks are then consumed without writing."""

    def __init__(self, stream: Any, buffers: list[torch.Tensor]) -> None:
        self._stream = stream
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for buffer in buffers:
            self._free.put(buffer)
        self._todo: queue.SimpleQueue[tuple[torch.Tensor, memoryview] | None] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lightning-async-ckpt-replica-write", daemon=True)
        self._thread.start()

    def take(self) -> torch.Tensor:
        """A free buffer (waits while both are being written)."""
        return self._free.get()

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer that received nothing to write."""
        self._free.put(buffer)

    def put(self, buffer: torch.Tensor, payload: memoryview) -> None:
        """Write ``payload`` (received into ``buffer``, or into a larger buffer of its own) behind the caller's next
        receive; ``buffer`` is free again once it is written."""
        self._todo.put((buffer, payload))

    def close(self) -> None:
        """Wait for every write."""
        self._todo.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            buffer, payload = item
            if self.failure is None:
                try:
                    self._stream.write(payload)
                except BaseException as exc:  # noqa: BLE001 - raised by the receiver after the object's last chunk
                    self.failure = exc
            self._free.put(buffer)


def version_uri(root: str, where: str) -> str:
    """The folder ``where`` (``""``: the tier itself, ``"v1"``, ...) of the local tier ``root``."""
    return f"{root.rstrip('/')}/{where}" if where else root


def tier_folder(root: str, where: Any) -> str:
    """Folder ``where`` of this rank's local tier ``root``, checked: a peer's message names it, and it must be a
    relative folder that stays inside ``root`` (no ``..``, not absolute, no URL, not through a link outside) and is
    one replicas go to (``""``, ``v<k>``, ``[v<k>/]rank-<r>``, ``[v<k>/]replica-of-rank-<r>``: never a generation's
    folder).

    Raises:
        ReplicaError: ``where`` leaves the tier (the sender is told; nothing is written).
    """
    parts = where.replace("\\", "/").split("/") if isinstance(where, str) else None
    outside = (
        parts is None
        or where.startswith(("/", "\\"))
        or "://" in where
        or ":" in parts[0]  # a drive letter
        or (where != "" and any(part in ("", ".", "..") for part in parts))
        or not _TIER_FOLDER_RE.fullmatch(
            where
        )  # inside the tier, yet not a folder replicas go to (a generation's, ...)
    )
    uri = version_uri(root, where) if not outside else ""
    protocol, path = split_protocol(root)
    if not outside and protocol in (None, "file", "local"):  # a local folder, also named as a URL: links resolved
        base = os.path.realpath(path)
        outside = os.path.commonpath([base, os.path.realpath(version_uri(path, where))]) != base
    if outside:
        raise ReplicaError(
            f"replica target folder {where!r} is not inside this rank's local tier {root!r}: a peer may only name a "
            'relative folder of it ("" or a version folder such as "v1", or a rank folder such as "rank-1" or '
            '"replica-of-rank-1" in one)'
        )
    return uri


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
    wire: Wire, src: int, header: dict[str, Any], root: str, *, where: str | None = None, background: bool = False
) -> Manifest | None:
    """Answer one ``GEN`` from ``src``: commit the generation in local folder ``root`` (its version folder, or
    ``where``), manifest last; the manifest committed, or ``None`` when the folder held it intact already or it
    failed (``src`` is told). A damaged committed copy there is left as it is and the generation is committed again
    into a new version folder (:func:`~lightning_async_ckpt.tiers.replica_repair.repair_where`).

    ``background``: once every byte is received and checked against the source manifest (in the page cache), answer
    and return; the objects' ``fsync`` and the commit run on a thread (:mod:`~lightning_async_ckpt.tiers.replica_persist`,
    whose ``manifest_of`` answers the returned manifest meanwhile). For a restart, which loads the files at once."""
    try:  # a peer's message: anything wrong with it is answered, never left to kill the receiving thread
        manifest = Manifest.from_json(header["manifest"], where=f"replica from rank {src}")
        relative = header["where"] if where is None else where
        store = _receiving_store(tier_folder(root, relative), manifest.run_id, background)
        step = manifest.step
        held, why = held_copy(store, manifest)  # an intact copy: every byte re-read, not only the manifest compared
    except Exception as exc:  # noqa: BLE001 - told to the sender, which raises it
        _log.warning("replica message from rank %d refused: %s: %s", src, type(exc).__name__, exc)
        wire.send(src, Kind.FAIL, f"{type(exc).__name__}: {exc}".encode())
        return None
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
        store = _receiving_store(version_uri(root, fresh), manifest.run_id, background)
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
        behind = _WriteBehind(stream, wire.buffers(2))
        try:
            while True:
                buffer = behind.take()
                kind, payload = wire.recv(src, into=buffer)
                if kind == Kind.DATA:
                    behind.put(buffer, payload)
                    continue
                behind.give(buffer)
                if kind == Kind.ABORT:
                    failure.append(ReplicaError(f"rank {src} aborted: {payload.decode(errors='replace')}"))
                break
        finally:
            behind.close()
        if behind.failure is not None:
            failure.insert(0, behind.failure)
        if failure:
            raise failure[0]

    try:
        copy_objects(writer, manifest, read_into)
        extra = {**manifest.extra, REPLICA_OF_KEY: {"rank": src, "step": step}}
        commit = {"cut": manifest.cut, "plan": manifest.plan, "timings": manifest.timings, "extra": extra}
        if isinstance(store.backend, DeferredSync):
            committed = commit_in_background(writer, store.backend, replace(manifest, extra=extra), **commit)
        else:
            committed = writer.commit(**commit)
    except Exception as exc:  # noqa: BLE001 - told to the sender; nothing is committed here
        writer.abort()
        if isinstance(store.backend, DeferredSync):
            store.backend.forget()
        if not failure:  # copy_objects stopped early: consume the rest so the sender reaches its last recv
            _drain_objects(wire, src, manifest, done=len(writer.objects))
        wire.send(src, Kind.FAIL, f"{type(exc).__name__}: {exc}".encode())
        _log.warning("replica of step %d from rank %d not committed in %s: %s", step, src, store.uri, exc)
        return None
    wire.send(src, Kind.OK)
    return committed


def receive_from(wire: Wire, src: int, root: str, where: str, step: int, *, background: bool = False) -> Manifest:
    """Receive generation ``step``, which ``src`` sends next, into folder ``where`` of local tier ``root``
    (:func:`receive_generation`; a restart's copy from a peer).

    Raises:
        ReplicaError: It was not received (``src`` was told).
    """
    kind, payload = wire.recv(src)
    header = json.loads(payload) if kind == Kind.GEN else None
    committed = (
        None if header is None else receive_generation(wire, src, header, root, where=where, background=background)
    )
    if committed is None:
        raise ReplicaError(f"step {step} could not be restored from rank {src}")
    return committed


def _receiving_store(uri: str, run_id: str, background: bool) -> CheckpointStore:
    """The store a generation is received into; with ``background`` (a local folder), objects go through the page
    cache and their ``fsync`` waits for the background commit."""
    store = CheckpointStore(uri, run_id=run_id, direct_io=not background)
    if background and store.is_local:
        store.backend = DeferredSync(store.backend)
    return store


def _drain_objects(wire: Wire, src: int, manifest: Manifest, done: int) -> None:
    for _ in manifest.objects[done:]:
        while wire.recv(src)[0] not in (Kind.EOF, Kind.ABORT):
            pass
