"""The checkpoint store: generations of data objects over any fsspec filesystem, committed by a manifest.

Layout::

    <root>/step-00000100/checkpoint.ckpt   data objects, written first and made durable
    <root>/step-00000100/manifest.json     written last: the commit marker

Commit protocol: on local disk the manifest is written to a temporary file in the generation's folder,
fsynced, ``os.replace``-d into place and the folder fsynced; on any other filesystem it is one ``pipe_file``
(a single PUT on object stores). Nothing relies on ``rename`` or ``fs.transaction`` for object stores.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_async_ckpt.errors import (
    ConfigError,
    GenerationExistsError,
    ManifestError,
    ManifestVersionError,
    StorageError,
)
from lightning_async_ckpt.storage.io import (
    DEFAULT_CHECKSUM,
    Checksum,
    DirectFile,
    atomic_local_write,
    checksum_algorithm,
    crc32c_module,
    fsync_dir,
    open_local_write,
)
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest, ObjectEntry, validate_object_name

# Old private names, kept while other packages move to the public ones in ``storage.io``.
_Checksum = Checksum
_DirectFile = DirectFile
_fsync_dir = fsync_dir
_atomic_local_write = atomic_local_write
_open_local = open_local_write
_checksum_algorithm = checksum_algorithm
_crc32c_module = crc32c_module

__all__ = ["CheckpointStore", "GenerationInfo", "GenerationWriter", "VerifyResult"]

_log = logging.getLogger(__name__)
_GEN_RE = re.compile(r"^step-(\d{8,})$")
_READ_CHUNK = 8 << 20
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


def generation_name(step: int) -> str:
    """Folder name of the generation for ``step`` (zero-padded so names sort by step)."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class GenerationInfo:
    """What a listing knows about one generation.

    Attributes:
        step: The generation's step.
        path: Its folder, as a URL of the store's filesystem.
        committed: Whether a valid manifest exists.
        manifest: The parsed manifest, when committed.
        error: Why a present manifest was rejected, if it was.
        newer_format: The manifest was written by a newer format version (never deleted or overwritten).
        unreadable: The manifest exists but could not be read (a storage error); retention leaves it alone.
        mtime: Newest modification time seen, when the filesystem reports one.
    """

    step: int
    path: str
    committed: bool
    manifest: Manifest | None = None
    error: str | None = None
    mtime: float | None = None
    newer_format: bool = False
    unreadable: bool = False

    @property
    def run_id(self) -> str | None:
        """The writer's run id, when committed."""
        return self.manifest.run_id if self.manifest else None


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :meth:`CheckpointStore.verify` for one generation.

    Attributes:
        step: The generation's step.
        ok: True when every object exists with the manifest's size and checksum.
        problems: One line per failed check.
    """

    step: int
    ok: bool
    problems: tuple[str, ...] = ()


class _ObjectStream:
    """A writable stream for one data object: counts and checksums bytes as they pass, holds none whole."""

    def __init__(self, writer: GenerationWriter, name: str, raw: IO[bytes], local: bool) -> None:
        self._writer = writer
        self.name = name
        self._raw = raw
        self._local = local
        self._sum = _Checksum(writer.checksum)
        self.size = 0
        self.closed = False
        self.failure: StorageError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._raw.write(view)
        except Exception as exc:
            # Serializers may replace this error with their own (torch.save raises a bare RuntimeError); keep it so
            # __exit__ re-raises the storage error, which decides retries (transient vs ENOSPC).
            self.failure = StorageError(f"could not write object {self.name!r} of {self._writer.path}: {exc}")
            raise self.failure from exc
        self._sum.update(view)
        self.size += len(view)
        return len(view)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        """Make the object durable and record it in the generation; idempotent."""
        if self.closed:
            return
        if self.failure is not None:
            # A write failed but the serializer carried on: the object is incomplete, never record it.
            self.abandon()
            raise self.failure
        self.closed = True
        try:
            if self._local:
                self._raw.flush()
                os.fsync(self._raw.fileno())
            self._raw.close()
        except Exception as exc:
            self._writer._discard(self.name)
            raise StorageError(f"could not finish object {self.name!r} of {self._writer.path}: {exc}") from exc
        self._writer._record(ObjectEntry(name=self.name, size=self.size, checksum=self._sum.hexdigest()))

    def abandon(self) -> None:
        """Close without recording (after a failed write)."""
        if not self.closed:
            self.closed = True
            try:
                self._raw.close()
            except Exception:  # noqa: BLE001 - the write already failed; its error is the one that matters
                _log.debug("closing abandoned object %s failed", self.name, exc_info=True)
            self._writer._discard(self.name)

    def __enter__(self) -> _ObjectStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()
            if self.failure is not None and exc is not self.failure:
                raise self.failure


class GenerationWriter:
    """Writes one generation: data objects as streams, then :meth:`commit` writes the manifest last.

    Call sequence: ``open(name)`` for each object (write, close), then ``commit(...)``; or ``abort()`` at any
    point. Not thread-safe: one thread writes a generation.
    """

    def __init__(self, store: CheckpointStore, step: int, checksum: str) -> None:
        self.store = store
        self.step = step
        self.checksum = checksum
        self.path = store._gen_path(step)
        self._objects: dict[str, ObjectEntry] = {}
        self._open: set[str] = set()
        self._done = False

    def open(self, name: str) -> _ObjectStream:
        """Open data object ``name`` for streaming writes.

        Args:
            name: Plain relative name inside the generation (``/`` for sub-folders).

        Returns:
            A binary, write-only, file-like stream; closing it makes the object durable.
        """
        self._check_open()
        validate_object_name(name)
        if name in self._objects or name in self._open:
            raise StorageError(f"object {name!r} was already written to generation step {self.step}")
        path = f"{self.path}/{name}"
        fs = self.store.fs
        try:
            if self.store.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                raw: IO[bytes] = _open_local(path, self.store.direct_io)
            else:
                if "/" in name:
                    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                raw = fs.open(path, "wb", **self.store._write_options)
        except Exception as exc:
            raise StorageError(f"could not open {path!r} for writing: {exc}") from exc
        self._open.add(name)
        return _ObjectStream(self, name, raw, self.store.is_local)

    def write_bytes(self, name: str, data: bytes) -> ObjectEntry:
        """Write a small object in one call and return its entry."""
        with self.open(name) as stream:
            stream.write(data)
        return self._objects[name]

    @property
    def objects(self) -> tuple[ObjectEntry, ...]:
        """Entries of the objects closed so far."""
        return tuple(self._objects.values())

    def commit(
        self,
        *,
        cut: dict[str, Any] | None = None,
        plan: dict[str, Any] | None = None,
        timings: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Write the manifest last, making the generation recoverable.

        Raises:
            StorageError: If an object is still open, or the manifest cannot be written (the generation stays
                uncommitted).
        """
        self._check_open()
        if self._open:
            raise StorageError(f"objects {sorted(self._open)} of step {self.step} are still open; close them first")
        manifest = Manifest(
            step=self.step,
            run_id=self.store.run_id,
            objects=self.objects,
            cut=dict(cut or {}),
            versions=_versions(),
            plan=dict(plan or {}),
            timings=dict(timings or {}),
            extra=dict(extra or {}),
            committed_at=time.time(),
        )
        data = manifest.to_json()
        path = f"{self.path}/{MANIFEST_NAME}"
        try:
            if self.store.is_local:
                _atomic_local_write(path, data)
                _fsync_dir(self.store.root)  # the generation folder's own entry
            else:
                self.store.fs.pipe_file(path, data)
        except Exception as exc:
            raise StorageError(f"could not write manifest {path!r}: {exc}") from exc
        finally:
            self._done = True
            self.store._end_write(self.step)
        self.store._invalidate()
        return manifest

    def abort(self) -> None:
        """Remove what was written; the generation never becomes committed. Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            self.store._remove_generation(self.step, manifest_first=False)
        except Exception:  # noqa: BLE001 - aborting is best effort; an uncommitted leftover is never trusted
            _log.warning("could not remove aborted generation %s", self.path, exc_info=True)
        finally:
            self.store._end_write(self.step)

    def _record(self, entry: ObjectEntry) -> None:
        self._open.discard(entry.name)
        self._objects[entry.name] = entry

    def _discard(self, name: str) -> None:
        self._open.discard(name)

    def _check_open(self) -> None:
        if self._done:
            raise StorageError(f"generation step {self.step} is already committed or aborted")


class CheckpointStore:
    """Generations of checkpoint objects under one fsspec URL.

    Thread-safety: listing, reading and ``gc`` may run on any thread; each :class:`GenerationWriter` is used by
    one thread at a time. Generations being written by this store are never touched by ``gc``.

    Args:
        uri: A local path, ``file://``, ``memory://``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: Passed to the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for S3).
        run_id: Identifier recorded in manifests; ``gc`` only removes this run's generations unless told
            otherwise. Default: a new random id.
        checksum: ``"crc32c"`` (default where the ``crc32c`` package is installed, several GB/s), ``"crc32"``
            (zlib) or ``"sha256"``.
        block_size: Multipart block size for object stores, in bytes (default 32 MiB).
        check_writable: Probe that the location is writable at construction (local and memory only).
        direct_io: On local disks, write data objects with ``O_DIRECT`` where the filesystem supports it
            (bypassing the page cache keeps checkpoint writes from stalling training); falls back to buffered
            writes elsewhere.

    Raises:
        ConfigError: Unknown scheme, missing optional dependency (names the extra to install), a location that
            cannot be written, or a bad argument.
    """

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        *,
        run_id: str | None = None,
        checksum: str | None = None,
        block_size: int | None = None,
        check_writable: bool = True,
        direct_io: bool = True,
    ) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise ConfigError(f"uri must be a non-empty path or URL string, got {uri!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        checksum = checksum or DEFAULT_CHECKSUM
        if checksum not in ("crc32c", "crc32", "sha256"):
            raise ConfigError(f"checksum must be 'crc32c', 'crc32' or 'sha256', got {checksum!r}")
        if checksum == "crc32c" and _crc32c_module() is None:
            raise ConfigError("checksum 'crc32c' needs the crc32c package: pip install crc32c")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 5 << 20):
            raise ConfigError(f"block_size must be an int of at least 5 MiB (S3's part minimum), got {block_size!r}")
        # A run id the manifest reader rejects would make every generation this store commits untrusted.
        if run_id is not None and not isinstance(run_id, str):
            raise ConfigError(f"run_id must be a string or None (a new random id), got {run_id!r}")
        if not isinstance(check_writable, bool):
            raise ConfigError(f"check_writable must be True or False, got {check_writable!r}")
        if not isinstance(direct_io, bool):
            raise ConfigError(f"direct_io must be True or False, got {direct_io!r}")
        self.direct_io = direct_io
        self.uri = uri
        self.storage_options = dict(storage_options or {})
        self.run_id = run_id or self.new_run_id()
        self.checksum = checksum
        self.fs, self.root = _make_fs(uri, self.storage_options)
        self.root = self.root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self._write_options: dict[str, Any] = {}
        if not self.is_local and "s3" in _protocols(self.fs):
            self._write_options["block_size"] = block_size or 32 << 20
        self._lock = threading.Lock()
        self._writing: set[int] = set()
        if check_writable:
            self._check_writable()

    @staticmethod
    def new_run_id() -> str:
        """A fresh random run id."""
        return uuid.uuid4().hex[:12]

    # -- paths -------------------------------------------------------------------------------------------
    def _gen_path(self, step: int) -> str:
        return f"{self.root}/{generation_name(step)}"

    def url(self, step: int, name: str | None = None) -> str:
        """Full URL (with protocol) of a generation folder or one of its objects."""
        path = self._gen_path(step) if name is None else f"{self._gen_path(step)}/{validate_object_name(name)}"
        return path if self.is_local else self.fs.unstrip_protocol(path)

    # -- writing -----------------------------------------------------------------------------------------
    def begin(self, step: int) -> GenerationWriter:
        """Start writing the generation for ``step``.

        An uncommitted leftover of the same step (a crashed writer) is removed first.

        Raises:
            ConfigError: If ``step`` is not a non-negative int.
            GenerationExistsError: If that step is already committed, or being written by this store.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        with self._lock:
            if step in self._writing:
                raise GenerationExistsError(f"generation step {step} is already being written in this process")
            self._writing.add(step)
        try:
            self._invalidate()
            manifest_path = f"{self._gen_path(step)}/{MANIFEST_NAME}"
            if self._holds_manifest(step, manifest_path):
                raise GenerationExistsError(
                    f"generation step {step} is already committed at {self.url(step)}; committed checkpoints are "
                    "never overwritten: use another dirpath, or remove it with `lightning-async-ckpt gc`"
                )
            if self.fs.exists(self._gen_path(step)):
                self.fs.rm(self._gen_path(step), recursive=True)
            if self.is_local:
                os.makedirs(self._gen_path(step), exist_ok=True)
        except GenerationExistsError:
            self._end_write(step)
            raise
        except Exception as exc:
            self._end_write(step)
            raise StorageError(f"could not prepare generation {self.url(step)}: {exc}") from exc
        return GenerationWriter(self, step, self.checksum)

    def _holds_manifest(self, step: int, manifest_path: str) -> bool:
        """Whether ``step`` has a manifest that must not be overwritten (valid, or from a newer format version).

        A manifest that cannot be parsed (a torn write on a filesystem without atomic puts) never made the
        generation recoverable: the generation is treated as an uncommitted leftover.
        """
        try:
            data = self.fs.cat_file(manifest_path)
        except FileNotFoundError:
            return False
        try:
            manifest = Manifest.from_json(data, where=f"{self.url(step)}/{MANIFEST_NAME}")
            if manifest.step != step:
                raise ManifestError(f"manifest of folder step {step} says step {manifest.step}")
        except ManifestVersionError:
            return True
        except ManifestError as exc:
            _log.warning(
                "generation %s has a corrupt manifest and was never recoverable; rewriting it (%s)", self.url(step), exc
            )
            return False
        return True

    def _end_write(self, step: int) -> None:
        with self._lock:
            self._writing.discard(step)

    # -- reading -----------------------------------------------------------------------------------------
    def generations(self, include_uncommitted: bool = False) -> list[GenerationInfo]:
        """List generations sorted by step.

        Args:
            include_uncommitted: Also list folders without a valid manifest (``committed=False``).
        """
        self._invalidate()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise StorageError(f"could not list {self.uri!r}: {exc}") from exc
        found = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _GEN_RE.match(name)
            if not match or entry.get("type") not in ("directory", None):
                continue
            info = self._read_generation(int(match.group(1)))
            if info.committed or include_uncommitted:
                found.append(info)
        return sorted(found, key=lambda g: g.step)

    def _read_generation(self, step: int) -> GenerationInfo:
        path = self._gen_path(step)
        try:
            data = self.fs.cat_file(f"{path}/{MANIFEST_NAME}")
        except FileNotFoundError:
            return GenerationInfo(step=step, path=self.url(step), committed=False, mtime=self._mtime(path))
        except Exception as exc:  # noqa: BLE001 - an unreadable manifest makes the generation untrusted, not fatal
            # Present but unreadable right now (a transient storage error): never treated as a leftover.
            return GenerationInfo(
                step=step, path=self.url(step), committed=False, error=f"unreadable manifest: {exc}", unreadable=True
            )
        try:
            manifest = Manifest.from_json(data, where=f"{self.url(step)}/{MANIFEST_NAME}")
            if manifest.step != step:
                raise ManifestError(f"manifest of folder step {step} says step {manifest.step}")
        except ManifestError as exc:
            newer = isinstance(exc, ManifestVersionError)
            return GenerationInfo(step=step, path=self.url(step), committed=False, error=str(exc), newer_format=newer)
        return GenerationInfo(
            step=step, path=self.url(step), committed=True, manifest=manifest, mtime=manifest.committed_at
        )

    def _mtime(self, path: str) -> float | None:
        try:
            info = self.fs.info(path)
        except Exception:  # noqa: BLE001 - the age of a leftover is informational
            return None
        value = info.get("mtime") or info.get("LastModified") or info.get("created")
        if hasattr(value, "timestamp"):
            return value.timestamp()
        return float(value) if isinstance(value, int | float) else None

    def manifest(self, step: int) -> Manifest:
        """Return the validated manifest of committed generation ``step``.

        Raises:
            ManifestError: If the generation is not committed or its manifest is invalid.
        """
        info = self._read_generation(step)
        if not info.committed or info.manifest is None:
            raise ManifestError(
                f"generation step {step} at {self.url(step)} is not committed ({info.error or 'no manifest'})"
            )
        return info.manifest

    def check_sizes(self, manifest: Manifest) -> list[str]:
        """Return problems with the objects' existence and sizes (empty when all match)."""
        problems = []
        for obj in manifest.objects:
            path = f"{self._gen_path(manifest.step)}/{obj.name}"
            try:
                size = self.fs.info(path).get("size")
            except FileNotFoundError:
                problems.append(f"{obj.name}: missing")
                continue
            except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
                problems.append(f"{obj.name}: cannot stat ({exc})")
                continue
            if size != obj.size:
                problems.append(f"{obj.name}: size {size}, manifest says {obj.size}")
        return problems

    def latest(self, *, verify: bool = False, run_id: str | None = None) -> GenerationInfo | None:
        """The newest committed generation whose objects exist with the manifest's sizes.

        Generations that fail the check are skipped with a warning, so a damaged newest generation falls back
        to the previous one.

        Args:
            verify: Also re-read and check checksums (slower).
            run_id: Only consider generations of this run.
        """
        for info in reversed(self.generations(include_uncommitted=True)):
            if not info.committed or info.manifest is None:
                if info.error:
                    warnings.warn(f"skipping generation {info.path}: {info.error}", stacklevel=2)
                continue
            if run_id is not None and info.run_id != run_id:
                continue
            problems = self.verify(info.step).problems if verify else tuple(self.check_sizes(info.manifest))
            if problems:
                warnings.warn(f"skipping generation {info.path}: {'; '.join(problems)}", stacklevel=2)
                continue
            return info
        return None

    def verify(self, step: int) -> VerifyResult:
        """Re-read every object of generation ``step`` and check size and checksum; never unpickles."""
        try:
            manifest = self.manifest(step)
        except ManifestError as exc:
            return VerifyResult(step=step, ok=False, problems=(str(exc),))
        problems = self.check_sizes(manifest)
        bad = {p.split(":", 1)[0] for p in problems}
        for obj in manifest.objects:
            if obj.name in bad:
                continue
            digest = _Checksum(_checksum_algorithm(obj.checksum))
            size = 0
            try:
                with self.fs.open(f"{self._gen_path(step)}/{obj.name}", "rb") as f:
                    while chunk := f.read(_READ_CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
            except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
                problems.append(f"{obj.name}: unreadable ({exc})")
                continue
            if size != obj.size:
                problems.append(f"{obj.name}: read {size} bytes, manifest says {obj.size}")
            elif digest.hexdigest() != obj.checksum:
                problems.append(f"{obj.name}: checksum {digest.hexdigest()}, manifest says {obj.checksum}")
        return VerifyResult(step=step, ok=not problems, problems=tuple(problems))

    def open(self, step: int, name: str) -> IO[bytes]:
        """Open object ``name`` of committed generation ``step`` for reading.

        Raises:
            ManifestError: If the generation is not committed or lists no such object.
        """
        manifest = self.manifest(step)
        try:
            manifest.object(name)
        except KeyError as exc:
            raise ManifestError(str(exc.args[0])) from exc
        return self.fs.open(f"{self._gen_path(step)}/{name}", "rb")

    # -- retention ---------------------------------------------------------------------------------------
    def gc(self, keep_last: int, *, all_runs: bool = False, dry_run: bool = False) -> list[int]:
        """Delete old generations; never the newest ``keep_last`` committed ones.

        Committed generations older than the newest ``keep_last`` are removed manifest first (so a crash leaves
        an uncommitted leftover, never a manifest without data), then their data. Uncommitted leftovers older
        than the newest commit are removed too. Generations being written by this store, newer uncommitted
        ones, and (unless ``all_runs``) other runs' generations are left alone.

        Args:
            keep_last: How many committed generations to keep (at least 1).
            all_runs: Also remove other runs' committed generations.
            dry_run: Only return what would be removed.

        Returns:
            The steps removed (or that would be).
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(
                f"keep_last must be an int >= 1 (the newest committed generation is kept), got {keep_last!r}"
            )
        gens = self.generations(include_uncommitted=True)
        committed = [g for g in gens if g.committed]
        if not committed:
            return []
        newest = committed[-1].step
        # keep_last counts the generations gc may delete: this run's (or all runs' with all_runs), so another run's
        # newer commits never push this run's own out.
        mine = [g for g in committed if all_runs or g.run_id == self.run_id]
        keep = {g.step for g in mine[-keep_last:]}
        with self._lock:
            writing = set(self._writing)
        doomed = []
        for g in gens:
            if g.step in keep or g.step in writing:
                continue
            # A rejected manifest never made its generation recoverable: collected like a leftover, unless it was
            # written by a newer version of this library (an upgrade can read it).
            leftover = not g.committed and not g.newer_format and not g.unreadable and g.step < newest
            if g.committed and (all_runs or g.run_id == self.run_id) or leftover:
                doomed.append(g)
        if dry_run:
            return [g.step for g in doomed]
        removed = []
        for g in doomed:
            try:
                self._remove_generation(g.step, manifest_first=g.committed)
                removed.append(g.step)
            except Exception:  # noqa: BLE001 - retention is best effort; a leftover is collected next time
                _log.warning("could not remove generation %s", g.path, exc_info=True)
        return removed

    def _remove_generation(self, step: int, *, manifest_first: bool) -> None:
        path = self._gen_path(step)
        if manifest_first:
            self.fs.rm_file(f"{path}/{MANIFEST_NAME}")
            if self.is_local:
                _fsync_dir(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self._invalidate()

    # -- helpers -----------------------------------------------------------------------------------------
    def _invalidate(self) -> None:
        # s3fs caches listings; a stale cache is how `last` lookups go wrong on object stores.
        try:
            self.fs.invalidate_cache()
        except Exception:  # noqa: BLE001 - not every filesystem caches
            pass

    def _check_writable(self) -> None:
        if not (self.is_local or "memory" in _protocols(self.fs)):
            return
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            probe = f"{self.root}/.write-probe-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as exc:
            raise ConfigError(
                f"dirpath {self.uri!r} is not writable ({exc}); choose a writable folder or fix its permissions"
            ) from exc

    def iter_objects(self, step: int) -> Iterator[tuple[ObjectEntry, str]]:
        """Yield each object of committed generation ``step`` with its full URL."""
        for obj in self.manifest(step).objects:
            yield obj, self.url(step, obj.name)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, run_id={self.run_id!r})"


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _make_fs(uri: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        extra = _EXTRAS.get(scheme)
        hint = f"pip install 'lightning_async_ckpt[{extra}]'" if extra else f"install the fsspec backend for {scheme!r}"
        raise ConfigError(f"uri {uri!r} needs an fsspec backend that is not installed: {hint} ({exc})") from exc
    except ValueError as exc:
        raise ConfigError(
            f"uri {uri!r} has unknown scheme {scheme!r}; use a local path, file://, memory://, s3:// or another "
            "fsspec protocol"
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        extra = _EXTRAS.get(scheme)
        hint = f"pip install 'lightning_async_ckpt[{extra}]'" if extra else f"install the fsspec backend for {scheme!r}"
        raise ConfigError(f"uri {uri!r} needs an fsspec backend that is not installed: {hint} ({exc})") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"could not open {uri!r} with storage_options {sorted(options)}: {exc}") from exc
    return fs, path


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("lightning_async_ckpt", "torch", "lightning", "fsspec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out
