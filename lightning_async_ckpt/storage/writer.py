"""The generation writer: data objects as checksummed streams, then the manifest, exclusively, last.

After ``CheckpointStore.begin`` claimed the step (:mod:`.claims`; an attempt without the step claim writes under its
own prefix ``w-<token>/``): ``open(name)`` each object (created exclusively), stream into it, close it; ``commit()``
checks the claim and every object, creates the manifest exclusively (the loser gets
:class:`GenerationExistsError` and its objects are removed) and checks the objects again; ``abort()`` removes only
this writer's objects and claims.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import time
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import GenerationExistsError, ManifestError, StorageError, WriterUsageError
from lightning_async_ckpt.storage.claims import (
    CLAIM_NAME,
    Lease,
    attempt_claim_name,
    claim_body,
    clear_leftovers,
    new_token,
    read_claim,
    take_step_claim,
)
from lightning_async_ckpt.storage.io import file_identity, same_file
from lightning_async_ckpt.storage.listing_check import check_listed, replaced_files
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest, ObjectEntry, validate_object_name
from lightning_async_ckpt.storage.object_stream import ObjectStream

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.view import StoreView

__all__ = [
    "CLAIM_NAME",
    "GenerationWriter",
    "ObjectStream",
    "claim_body",
    "claim_step",
    "new_token",
]

_log = logging.getLogger(__name__)


class GenerationWriter:
    """Writes one generation: data objects as streams, then :meth:`commit` writes the manifest last.

    Not thread-safe: one thread writes a generation. See the module docstring for the call sequence.

    Args:
        store: The store.
        step: The generation's step.
        checksum: The checksum algorithm of its objects.
        prefix: Where this writer's objects go inside the generation (``""``: at their names).
        claim: Path of the step claim this writer holds (plain names), ``None`` under a prefix.
        token: The attempt's token (a new one by default).
        lease: This writer's attempt claim, renewed at each write and released at the end.
    """

    def __init__(
        self,
        store: StoreView,
        step: int,
        checksum: str,
        *,
        prefix: str = "",
        claim: str | None = None,
        token: str | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.store = store
        self.step = step
        self.checksum = checksum
        self.path = store.generation_path(step)
        self.prefix = prefix
        self.token = token or new_token()
        self.lease = lease
        self._claim = claim
        self._idents: dict[str, tuple[int, int] | None] = {}
        self._objects: dict[str, ObjectEntry] = {}
        self._open: set[str] = set()
        self._written: set[str] = set()
        self._keys: dict[str, str] = {}
        self._done = False

    def place(self, name: str, key: str) -> None:
        """Write object ``name`` to the file ``key`` of the generation instead of a file called ``name``.

        The manifest records ``key`` as the object's path; readers look the object up by ``name``. The Lightning
        callback names its checkpoint file after the rendered ``filename`` template this way.

        Raises:
            WriterUsageError: ``name`` was already opened, or another object uses ``key``.
            ManifestError: ``key`` is not a valid object name (or is the manifest's or a claim's).
        """
        self._check_open()
        validate_object_name(key)
        if key == MANIFEST_NAME or key.startswith(("w-", ".writer")):
            raise ManifestError(f"object file name {key!r} is reserved by the store")
        if name in self._objects or name in self._open:
            raise WriterUsageError(f"object {name!r} of generation step {self.step} is already written")
        taken = {self._keys.get(n, n) for n in (*self._objects, *self._open)} | set(self._keys.values())
        if key != self._keys.get(name) and key in taken:
            raise WriterUsageError(f"another object of generation step {self.step} is written to {key!r}")
        self._keys[name] = key

    def key_of(self, name: str) -> str:
        """Where object ``name`` is written, relative to the generation folder (prefix included)."""
        return self.prefix + self._keys.get(name, name)

    def open(self, name: str) -> ObjectStream:
        """Open data object ``name`` for streaming writes.

        Args:
            name: Plain relative name inside the generation (``/`` for sub-folders).

        Returns:
            A binary, write-only, file-like stream; closing it makes the object durable.

        Raises:
            WriterUsageError: The object was already opened, or the writer is committed or aborted.
            StorageError: The object cannot be created.
        """
        self._check_open()
        validate_object_name(name)
        if name in self._objects or name in self._open:
            raise WriterUsageError(f"object {name!r} was already written to generation step {self.step}")
        key = self.key_of(name)
        path = f"{self.path}/{key}"
        try:
            raw = self.store.backend.open_write(path, direct_io=self.store.direct_io, subfolder="/" in key)
        except Exception as exc:
            raise StorageError(f"could not open {path!r} for writing: {exc}") from exc
        self._open.add(name)
        self._written.add(key)
        if self.store.is_local:
            self._idents[key] = file_identity(raw)
        return ObjectStream(self, name, raw)

    def renew(self) -> None:
        """Renew this writer's lease when it is due (called at each write)."""
        if self.lease is not None:
            self.lease.renew()

    def write_bytes(self, name: str, data: bytes) -> ObjectEntry:
        """Write a small object in one call and return its entry."""
        with self.open(name) as stream:
            stream.write(data)
        return self._objects[name]

    @property
    def objects(self) -> tuple[ObjectEntry, ...]:
        """Entries of the objects closed so far."""
        return tuple(self._objects.values())

    def record(self, entry: ObjectEntry) -> None:
        """Add an object that another process wrote into this generation (a rank of a sharded save).

        It is listed by :meth:`commit` and, like this writer's own objects, checked before and after the manifest
        and removed when another writer wins the step.

        Raises:
            WriterUsageError: The name was already recorded or written, or the writer is committed or aborted.
        """
        self._check_open()
        validate_object_name(entry.name)
        if entry.name in self._objects or entry.name in self._open:
            raise WriterUsageError(f"object {entry.name!r} of generation step {self.step} was recorded twice")
        self._objects[entry.name] = entry
        self._written.add(entry.key)

    def commit(
        self,
        *,
        cut: dict[str, Any] | None = None,
        plan: dict[str, Any] | None = None,
        timings: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Write the manifest last and exclusively, making the generation recoverable.

        Raises:
            WriterUsageError: An object is still open, or the writer is already committed or aborted.
            GenerationExistsError: Another writer committed this step first; this writer's objects were removed.
            StorageError: An object vanished or shrank before or after the manifest was written (the manifest is
                removed again), or the manifest cannot be written. The generation is not committed.
        """
        self._check_open()
        if self._open:
            raise WriterUsageError(f"objects {sorted(self._open)} of step {self.step} are still open; close them first")
        manifest = Manifest(
            step=self.step,
            run_id=self.store.run_id,
            objects=self.objects,
            cut=dict(cut or {}),
            versions=dict(_versions()),
            plan=dict(plan or {}),
            timings=dict(timings or {}),
            extra=dict(extra or {}),
            committed_at=time.time(),
        )
        data = manifest.to_json()
        path = f"{self.path}/{MANIFEST_NAME}"
        try:
            self._check_own(manifest)
            self._check_objects(manifest, "before")
            try:
                self.store.backend.create_exclusive(path, data)
            except FileExistsError as exc:
                if not self.store.backend.holds(path, data):  # a retried PUT whose first attempt landed wins
                    self._remove_own()
                    raise GenerationExistsError(
                        f"generation step {self.step} at {self.store.url(self.step)} was committed by another "
                        "writer first; this writer's objects were removed and the other writer's are kept"
                    ) from exc
            except Exception as exc:
                raise StorageError(f"could not write manifest {path!r}: {exc}") from exc
            self.store.backend.sync_folder(self.store.root)  # the generation folder's own entry
            try:
                self._check_objects(manifest, "after")
            except StorageError:
                self._remove_manifest(path)
                raise
            self.store.ledger.committed(self.store.location, manifest)  # the next retention pass need not read it
            self._release_claim()  # the attempt ended: its claim would only keep retention away later
        finally:
            self._done = True
            if self.lease is not None:
                self.lease.release()
            self.store.end_write(self.step, owns_folder=not self.prefix)
            self.store.invalidate_cache()
        return manifest

    def abort(self) -> None:
        """Remove what this writer wrote (never another writer's objects); idempotent."""
        if self._done:
            return
        self._done = True
        try:
            self._remove_own()
        except Exception:  # noqa: BLE001 - aborting is best effort; an uncommitted leftover is never trusted
            _log.warning("could not remove aborted generation %s", self.path, exc_info=True)
        finally:
            self.store.end_write(self.step, owns_folder=not self.prefix)

    def _release_claim(self) -> None:
        if self._claim is not None and self._holds_claim():
            with contextlib.suppress(FileNotFoundError):
                self.store.fs.rm_file(self._claim)

    def _holds_claim(self) -> bool:
        body = read_claim(self.store.fs, self._claim) if self._claim else None
        return body is not None and body.get("token") == self.token

    def _check_own(self, manifest: Manifest) -> None:
        """Fencing before the manifest: the step claim is still this attempt's, its objects still its own."""
        if self._claim is not None and not self._holds_claim():
            raise StorageError(
                f"generation step {self.step} at {self.store.url(self.step)}: this writer's claim was taken over "
                "(its lease expired while it was stalled); the step is NOT committed by this writer"
            )
        changed = replaced_files(self.path, manifest, self._idents)
        if changed:
            raise StorageError(
                f"generation step {self.step} at {self.store.url(self.step)}: objects {changed} were replaced by "
                "another writer; the step is NOT committed by this writer"
            )

    def _owns(self, key: str) -> bool:
        """Whether the object at ``key`` is this attempt's (never remove or commit another attempt's)."""
        if key in self._idents and self._idents[key] is not None:
            return same_file(f"{self.path}/{key}", self._idents[key])
        if (self.prefix and key.startswith(self.prefix)) or self.token in key.rsplit("/", 1)[-1]:
            return True
        return self._claim is not None and self._holds_claim()

    def _check_objects(self, manifest: Manifest, when: str) -> None:
        # One listing of the generation, not a HEAD per object (:mod:`.listing_check`).
        problems = check_listed(self.store.location, manifest)
        if problems:
            raise StorageError(
                f"generation step {self.step} at {self.store.url(self.step)}: objects changed {when} the manifest "
                f"was written ({'; '.join(problems)}); another process removed or rewrote them (retention of "
                "another run on the same dirpath?). The step is NOT committed"
            )

    def _remove_manifest(self, path: str) -> None:
        try:
            self.store.fs.rm_file(path)
            self.store.backend.sync_folder(self.path)
        except Exception:  # noqa: BLE001 - the raised error says the step is not committed
            _log.warning("could not remove manifest %s of a damaged commit", path, exc_info=True)

    def _remove_own(self) -> None:
        for key in sorted(self._written):
            if not self._owns(key):
                continue  # a later attempt's object at the same name: this writer's was orphaned
            with contextlib.suppress(FileNotFoundError):
                self.store.fs.rm_file(f"{self.path}/{key}")
        self._release_claim()
        if self.lease is not None:
            self.lease.release()
        self.store.backend.remove_folder_if_empty(self.path)
        self.store.invalidate_cache()

    def _record(self, entry: ObjectEntry) -> None:
        self._open.discard(entry.name)
        self._objects[entry.name] = entry

    def _discard(self, name: str, *, partial: bool = False) -> None:
        self._open.discard(name)
        key = self.key_of(name)
        if partial and key in self._idents and self._owns(key):
            # The name may be opened again by this writer (a retried object): its partial file goes now.
            try:
                self.store.fs.rm_file(f"{self.path}/{key}")
            except OSError:
                _log.debug("could not remove partial object %s", key, exc_info=True)
            self._written.discard(key)
            self._idents.pop(key, None)

    def _check_open(self) -> None:
        if self._done:
            raise WriterUsageError(f"generation step {self.step} is already committed or aborted")


@functools.cache
def _versions() -> dict[str, str]:
    # Read once per process: looking the distributions up scans every site-packages entry (5-30 ms per commit on
    # the 2-core machine, docs/benchmarks.md); callers copy the dict.
    out = {}
    for dist in ("lightning_async_ckpt", "torch", "lightning", "fsspec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def claim_step(store: StoreView, step: int) -> GenerationWriter:
    """Claim ``step`` for a new attempt (plain names), or give it its own prefix when another attempt holds it.

    Every attempt holds an attempt claim with a lease (:class:`~.claims.Lease`) from here until it ends.
    """
    path = store.generation_path(step)
    store.backend.prepare_folder(path)
    token = new_token()
    name = attempt_claim_name(token, 0)
    if take_step_claim(store.location, path, claim_body(store.run_id, step, token)):
        claim = f"{path}/{CLAIM_NAME}"
        lease = Lease(store, f"{path}/{name}", step, token)
        try:
            lease.create()
            foreign = clear_leftovers(store.location, path, keep={CLAIM_NAME, name})
        except BaseException:
            lease.release()
            store.fs.rm_file(claim)
            raise
        if not foreign:
            return GenerationWriter(store, step, store.checksum, claim=claim, token=token, lease=lease)
        lease.release()  # files the library never wrote are never replaced: this attempt writes beside them
        store.fs.rm_file(claim)
        why = f"holds files not written by lightning_async_ckpt ({', '.join(sorted(foreign)[:5])}): left alone"
    else:
        why = "is claimed by another writer"
    prefix = f"w-{token}/"
    store.backend.prepare_folder(f"{path}/{prefix}")
    lease = Lease(store, f"{path}/{prefix}{name}", step, token)
    lease.create()
    _log.warning("generation %s %s; writing under %s", store.url(step), why, prefix)
    return GenerationWriter(store, step, store.checksum, prefix=prefix, token=token, lease=lease)
