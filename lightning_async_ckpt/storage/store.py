"""The checkpoint store: generations of data objects over any fsspec filesystem, committed by a manifest.

Layout::

    <root>/step-00000100/checkpoint.ckpt   data objects, written first and made durable
    <root>/step-00000100/.writer.json      the writer's claim on the step (run id, host, pid)
    <root>/step-00000100/manifest.json     written last and exclusively: the commit marker

The store lists, reads, verifies and finds the latest generation (one manifest reader, size-capped); writing
is :mod:`~lightning_async_ckpt.storage.writer`, retention :mod:`~lightning_async_ckpt.storage.retention`, and
what differs per filesystem :mod:`~lightning_async_ckpt.storage.backend`.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import socket
import threading
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec

from lightning_async_ckpt.errors import (
    ConfigError,
    GenerationExistsError,
    ManifestError,
    ManifestVersionError,
    StorageError,
    StoreUnavailableError,
)
from lightning_async_ckpt.storage import retention
from lightning_async_ckpt.storage.backend import backend_for, protocols
from lightning_async_ckpt.storage.io import (
    DEFAULT_CHECKSUM,
    Checksum,
    DirectFile,
    atomic_local_write,
    checksum_algorithm,
    crc32c_module,
    fsync_dir,
    open_local_write,
    read_verified,
)
from lightning_async_ckpt.storage.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    ObjectEntry,
    validate_object_name,
)
from lightning_async_ckpt.storage.writer import CLAIM_NAME, GenerationWriter, claim_body, new_token

# Old private names, kept while other packages move to the public ones in ``storage.io`` / ``storage.backend``.
_Checksum = Checksum
_DirectFile = DirectFile
_fsync_dir = fsync_dir
_atomic_local_write = atomic_local_write
_open_local = open_local_write
_checksum_algorithm = checksum_algorithm
_crc32c_module = crc32c_module
_protocols = protocols

__all__ = [
    "CheckpointStore",
    "GenerationInfo",
    "GenerationState",
    "GenerationWriter",
    "Listing",
    "Skipped",
    "VerifyResult",
    "generation_name",
    "parse_generation_name",
]

_log = logging.getLogger(__name__)
_GEN_RE = re.compile(r"^step-([0-9]{8,})$")
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}


def generation_name(step: int) -> str:
    """Folder name of the generation for ``step`` (zero-padded so names sort by step)."""
    return f"step-{step:08d}"


def parse_generation_name(name: str) -> int | None:
    """The step of a canonical generation folder name, or ``None`` (``step-000000004`` and non-ASCII digits
    are not canonical: two names for one step would make retention and listing disagree)."""
    match = _GEN_RE.match(name)
    if not match or generation_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


class GenerationState(enum.Enum):
    """What a listed generation is."""

    COMMITTED = "committed"
    UNCOMMITTED = "uncommitted"  # no manifest: in progress, or a crashed write
    REJECTED = "rejected"  # a manifest that is invalid (never recoverable)
    NEWER_FORMAT = "newer_format"  # written by a newer library version: never deleted or overwritten
    UNREADABLE = "unreadable"  # present but could not be read right now: left alone


@dataclass(frozen=True)
class GenerationInfo:
    """What a listing knows about one generation.

    Attributes:
        step: The generation's step.
        path: Its folder, as a URL of the store's filesystem.
        committed: Whether a valid manifest exists.
        manifest: The parsed manifest, when committed.
        error: Why a present manifest was rejected, if it was.
        mtime: Newest modification time seen, when the filesystem reports one.
        newer_format: The manifest was written by a newer format version (never deleted or overwritten).
        unreadable: The manifest exists but could not be read (a storage error); retention leaves it alone.
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

    @property
    def state(self) -> GenerationState:
        """The generation's state."""
        if self.committed:
            return GenerationState.COMMITTED
        if self.newer_format:
            return GenerationState.NEWER_FORMAT
        if self.unreadable:
            return GenerationState.UNREADABLE
        return GenerationState.REJECTED if self.error else GenerationState.UNCOMMITTED


@dataclass(frozen=True)
class Skipped:
    """An entry of the store's folder that a listing did not read as a generation, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class Listing:
    """A listing: the generations, and what was skipped (never silently)."""

    generations: list[GenerationInfo] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


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


class CheckpointStore:
    """Generations of checkpoint objects under one fsspec URL.

    Thread-safety: listing, reading and ``gc`` may run on any thread; each :class:`GenerationWriter` is used by
    one thread at a time. Generations being written by this store are never touched by ``gc``.

    Args:
        uri: A local path, ``file://``, ``memory://``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: Passed to the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for S3).
        run_id: Identifier recorded in manifests and writer claims; ``gc`` only removes this run's generations
            unless told otherwise. Default: a new random id.
        checksum: ``"crc32c"`` (default where the ``crc32c`` package is installed, several GB/s), ``"crc32"``
            (zlib) or ``"sha256"``.
        block_size: Multipart block size for object stores, in bytes (default 32 MiB).
        check_writable: Probe the location at construction: local and memory are written to; an object store's
            bucket must exist and be listable.
        direct_io: On local disks, write data objects with ``O_DIRECT`` where the filesystem supports it
            (bypassing the page cache keeps checkpoint writes from stalling training); falls back to buffered
            writes elsewhere.

    Raises:
        ConfigError: Unknown scheme, missing optional dependency (names the extra to install), a location that
            cannot be written (names the bucket when it is missing), or a bad argument.
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
        if checksum == "crc32c" and crc32c_module() is None:
            raise ConfigError("checksum 'crc32c' needs the crc32c package: pip install crc32c")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 5 << 20):
            raise ConfigError(f"block_size must be an int of at least 5 MiB (S3's part minimum), got {block_size!r}")
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
        self.fs, root = _make_fs(uri, self.storage_options)
        self.root = root.rstrip("/") or "/"
        self.backend = backend_for(self.fs, block_size)
        self.is_local = self.backend.kind == "local"
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
        """Full URL (with protocol) of a generation folder, or of ``name``'s default location in it."""
        path = self._gen_path(step) if name is None else f"{self._gen_path(step)}/{validate_object_name(name)}"
        return self.backend.url(path)

    def object_url(self, step: int, name: str) -> str:
        """Full URL of object ``name`` of committed generation ``step``, where its manifest says it is."""
        return self.url(step, self._entry(self.manifest(step), name).key)

    # -- writing -----------------------------------------------------------------------------------------
    def begin(self, step: int) -> GenerationWriter:
        """Start writing the generation for ``step``: claim it, or write under a private prefix.

        A torn manifest (never recoverable) is removed. If another writer claims the step (alive, or crashed
        on another host), this writer's objects go under ``w-<token>/`` so neither overwrites the other; the
        exclusive manifest decides which commits.

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
            path = self._gen_path(step)
            if self._holds_manifest(step, f"{path}/{MANIFEST_NAME}"):
                raise GenerationExistsError(
                    f"generation step {step} is already committed at {self.url(step)}; committed checkpoints are "
                    "never overwritten: use another dirpath, or remove it with `lightning-async-ckpt gc`"
                )
            self.backend.prepare_folder(path)
            token = new_token()
            claim = f"{path}/{CLAIM_NAME}"
            if self._claim(claim, step, token):
                return GenerationWriter(self, step, self.checksum, claim=claim)
            prefix = f"w-{token}/"
            self.backend.prepare_folder(f"{path}/{prefix}")
            self.fs.pipe_file(f"{path}/{prefix}{CLAIM_NAME}", claim_body(self.run_id, step, token))
            _log.warning("generation %s is claimed by another writer; writing under %s", self.url(step), prefix)
            return GenerationWriter(self, step, self.checksum, prefix=prefix, claim=f"{path}/{prefix}{CLAIM_NAME}")
        except GenerationExistsError:
            self.end_write(step)
            raise
        except Exception as exc:
            self.end_write(step)
            raise StorageError(f"could not prepare generation {self.url(step)}: {exc}") from exc

    def _claim(self, claim: str, step: int, token: str) -> bool:
        body = claim_body(self.run_id, step, token)
        try:
            self.backend.create_exclusive(claim, body)
            return True
        except FileExistsError:
            pass
        if not _stale_local_claim(self.fs, claim):
            return False
        # The claimant was a process of this host that is gone (a crash): take the step over.
        self.fs.rm_file(claim)
        try:
            self.backend.create_exclusive(claim, body)
        except FileExistsError:
            return False
        return True

    def _holds_manifest(self, step: int, manifest_path: str) -> bool:
        """Whether ``step`` has a manifest that must not be overwritten (valid, or from a newer format version).

        A manifest that cannot be parsed (a torn write on a filesystem without atomic puts) never made the
        generation recoverable: it is removed, so the step can be committed.
        """
        info = self._read_generation(step)
        if info.unreadable:
            raise StorageError(f"cannot tell whether step {step} is committed: {info.error}")
        if info.committed or info.newer_format:
            return True
        if info.error:
            _log.warning("generation %s has a corrupt manifest and was never recoverable (%s)", info.path, info.error)
            self.fs.rm_file(manifest_path)
        return False

    def end_write(self, step: int) -> None:
        """Release this store's in-process hold on ``step`` (a writer's commit and abort call it)."""
        with self._lock:
            self._writing.discard(step)

    _end_write = end_write  # old private name, kept for callers that have not moved yet

    def writing(self) -> frozenset[int]:
        """Steps this store is writing now."""
        with self._lock:
            return frozenset(self._writing)

    # -- reading -----------------------------------------------------------------------------------------
    def scan(self, include_uncommitted: bool = True) -> Listing:
        """List generations and name every entry skipped (a non-canonical name, a file where a folder belongs).

        Raises:
            StoreUnavailableError: The location cannot be listed (missing bucket, unreachable endpoint, no
                permission). A local folder that does not exist yet lists as empty.
        """
        self._invalidate()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError as exc:
            why = self.backend.missing_root_error(self.root)
            if why is None:
                return Listing()
            raise StoreUnavailableError(f"cannot list {self.uri!r}: {why}") from exc
        except Exception as exc:
            raise StoreUnavailableError(f"could not list {self.uri!r}: {type(exc).__name__}: {exc}") from exc
        found, skipped = [], []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            step = parse_generation_name(name)
            if step is None:
                if name.startswith("step-"):
                    skipped.append(Skipped(name, "not a canonical generation name (step- and 8+ ASCII digits)"))
                continue
            if entry.get("type") not in ("directory", None):
                skipped.append(Skipped(name, f"a {entry.get('type')}, not a folder"))
                continue
            if not self.backend.inside(self._gen_path(step), self.root):
                skipped.append(Skipped(name, "resolves outside the store root (symlink)"))
                continue
            info = self._read_generation(step)
            if info.committed or include_uncommitted:
                found.append(info)
        return Listing(sorted(found, key=lambda g: g.step), sorted(skipped, key=lambda s: s.name))

    def generations(self, include_uncommitted: bool = False) -> list[GenerationInfo]:
        """List generations sorted by step (see :meth:`scan` for what is skipped and the errors).

        Args:
            include_uncommitted: Also list folders without a valid manifest (``committed=False``).
        """
        return self.scan(include_uncommitted).generations

    def _read_generation(self, step: int) -> GenerationInfo:
        """The one manifest reader: size-capped, validated, its step checked against the folder's."""
        path = self._gen_path(step)
        url = self.url(step)
        try:
            data = self._cat_capped(f"{path}/{MANIFEST_NAME}")
        except FileNotFoundError:
            return GenerationInfo(step=step, path=url, committed=False, mtime=self._mtime(path))
        except Exception as exc:  # noqa: BLE001 - an unreadable manifest makes the generation untrusted, not fatal
            # Present but unreadable right now (a transient storage error): never treated as a leftover.
            error = f"unreadable manifest: {exc}"
            return GenerationInfo(step=step, path=url, committed=False, error=error, unreadable=True)
        try:
            manifest = Manifest.from_json(data, where=f"{url}/{MANIFEST_NAME}")
            if manifest.step != step:
                raise ManifestError(f"manifest of folder step {step} says step {manifest.step}")
        except ManifestError as exc:
            newer = isinstance(exc, ManifestVersionError)
            return GenerationInfo(step=step, path=url, committed=False, error=str(exc), newer_format=newer)
        return GenerationInfo(step=step, path=url, committed=True, manifest=manifest, mtime=manifest.committed_at)

    def _cat_capped(self, path: str) -> bytes:
        # A ranged read never pulls more than the cap (a hostile 1 GB manifest costs 16 MiB); object stores refuse
        # a range on an empty object, which is then read as empty (and rejected as a manifest).
        try:
            return self.fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            raise
        except Exception as exc:
            try:
                empty = self.fs.info(path).get("size") == 0
            except Exception:  # noqa: BLE001 - the read's own error is the one to report
                empty = False
            if empty:
                return b""
            raise exc from None

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

    def _object_path(self, step: int, obj: ObjectEntry) -> str:
        path = f"{self._gen_path(step)}/{obj.key}"
        if not self.backend.inside(path, self.root):
            raise ManifestError(f"{obj.name}: resolves outside the store root {self.uri!r} (symlink); refused")
        return path

    def check_sizes(self, manifest: Manifest) -> list[str]:
        """Return problems with the objects' existence, location and sizes (empty when all match)."""
        problems = []
        for obj in manifest.objects:
            try:
                size = self.fs.info(self._object_path(manifest.step, obj)).get("size")
            except ManifestError as exc:
                problems.append(str(exc))
                continue
            except FileNotFoundError:
                problems.append(f"{obj.name}: missing")
                continue
            except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
                problems.append(f"{obj.name}: cannot stat ({exc})")
                continue
            if size != obj.size:
                problems.append(f"{obj.name}: size {size}, manifest says {obj.size}")
        return problems

    def latest(self, *, verify: bool = True, run_id: str | None = None) -> GenerationInfo | None:
        """The newest committed generation that is intact, for resuming.

        With ``verify`` (the default) every object of the returned generation was re-read once and matched its
        checksum; without it (for listings) sizes only. A generation that fails is skipped with a warning, so a
        damaged newest generation falls back to the newest intact one.

        Args:
            verify: Check checksums (reads every byte of the returned generation once).
            run_id: Only consider generations of this run.

        Raises:
            StoreUnavailableError: The location cannot be listed (never reported as "no checkpoint").
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
        """Re-read every object of generation ``step`` once and check size and checksum; never unpickles."""
        try:
            manifest = self.manifest(step)
        except ManifestError as exc:
            return VerifyResult(step=step, ok=False, problems=(str(exc),))
        problems = self.check_sizes(manifest)
        bad = {p.split(":", 1)[0] for p in problems}
        for obj in manifest.objects:
            if obj.name in bad:
                continue
            path = self._object_path(step, obj)
            try:
                read_verified(self.fs, path, obj, into=_Discard())
            except ManifestError as exc:
                problems.append(obj.name + str(exc).removeprefix(path))
            except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
                problems.append(f"{obj.name}: unreadable ({exc})")
        return VerifyResult(step=step, ok=not problems, problems=tuple(problems))

    def open(self, step: int, name: str) -> IO[bytes]:
        """Open object ``name`` of committed generation ``step`` for reading.

        Raises:
            ManifestError: If the generation is not committed, lists no such object, or it resolves outside
                the store's root.
        """
        manifest = self.manifest(step)
        return self.fs.open(self._object_path(step, self._entry(manifest, name)), "rb")

    @staticmethod
    def _entry(manifest: Manifest, name: str) -> ObjectEntry:
        try:
            return manifest.object(name)
        except KeyError as exc:
            raise ManifestError(str(exc.args[0])) from exc

    def iter_objects(self, step: int) -> Iterator[tuple[ObjectEntry, str]]:
        """Yield each object of committed generation ``step`` with its full URL."""
        for obj in self.manifest(step).objects:
            yield obj, self.backend.url(self._object_path(step, obj))

    # -- retention ---------------------------------------------------------------------------------------
    def retain(
        self,
        keep_last: int,
        *,
        all_runs: bool = False,
        dry_run: bool = False,
        verify: bool = False,
        min_leftover_age_s: float = 0.0,
    ) -> retention.RetentionReport:
        """Apply retention and report ``removed``, ``failed`` and ``refused`` (rules: :mod:`.retention`).

        Args:
            keep_last: How many verified complete committed generations to keep (at least 1).
            all_runs: Act for every run in the folder (the operator), not only this store's run.
            dry_run: Only plan; ``removed`` lists what would be removed.
            verify: Verify checksums of the generations counted as kept (otherwise only those up to 64 MiB).
            min_leftover_age_s: With ``all_runs``, leave other runs' uncommitted leftovers younger than this.
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(
                f"keep_last must be an int >= 1 (the newest committed generation is kept), got {keep_last!r}"
            )
        return retention.execute(
            self, keep_last, all_runs=all_runs, dry_run=dry_run, verify=verify, min_leftover_age_s=min_leftover_age_s
        )

    def gc(self, keep_last: int, *, all_runs: bool = False, dry_run: bool = False) -> list[int]:
        """Delete old generations and return the steps removed (or that would be); see :meth:`retain`."""
        return self.retain(keep_last, all_runs=all_runs, dry_run=dry_run).removed

    # -- helpers -----------------------------------------------------------------------------------------
    def _invalidate(self) -> None:
        # s3fs caches listings; a stale cache is how `last` lookups go wrong on object stores.
        try:
            self.fs.invalidate_cache()
        except Exception:  # noqa: BLE001 - not every filesystem caches
            pass

    def _check_writable(self) -> None:
        if not (self.is_local or "memory" in protocols(self.fs)):
            why = self.backend.missing_root_error(self.root)
            if why is not None:
                raise ConfigError(f"dirpath {self.uri!r} cannot be used: {why}; create it or fix the URL")
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

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, run_id={self.run_id!r})"


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _stale_local_claim(fs: fsspec.AbstractFileSystem, claim: str) -> bool:
    """Whether a claim was left by a process of this host that no longer exists (a crashed writer)."""
    import json

    try:
        body = json.loads(fs.cat_file(claim, start=0, end=64 << 10))
        if body.get("host") != socket.gethostname() or not isinstance(body.get("pid"), int):
            return False
        os.kill(body["pid"], 0)
    except ProcessLookupError:
        return True
    except Exception:  # noqa: BLE001 - unreadable or foreign: not provably stale
        return False
    return False


def _make_fs(uri: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    extra = _EXTRAS.get(scheme)
    hint = f"pip install 'lightning_async_ckpt[{extra}]'" if extra else f"install the fsspec backend for {scheme!r}"
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(f"uri {uri!r} needs an fsspec backend that is not installed: {hint} ({exc})") from exc
    except ValueError as exc:
        raise ConfigError(
            f"uri {uri!r} has unknown scheme {scheme!r}; use a local path, file://, memory://, s3:// or another "
            "fsspec protocol"
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        raise ConfigError(f"uri {uri!r} needs an fsspec backend that is not installed: {hint} ({exc})") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"could not open {uri!r} with storage_options {sorted(options)}: {exc}") from exc
    return fs, path
