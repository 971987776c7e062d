"""The checkpoint store: generations of data objects over any fsspec filesystem, committed by a manifest.

Layout::

    <root>/step-00000100/checkpoint.ckpt   data objects, written first and made durable
    <root>/step-00000100/.writer.json      the writer's claim on the step (run id, host, pid)
    <root>/step-00000100/manifest.json     written last and exclusively: the commit marker

The store is the facade of one location for one run. It inherits the reading half (:mod:`.reading`: listing, the
one manifest reader, verification, the newest intact generation) and adds what belongs to a run: writing (the
claim here, the rest in :mod:`.writer`), resuming (the run id) and retention (:mod:`.retention`). What differs
per filesystem is :mod:`.backend`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from lightning_async_ckpt.errors import (
    CheckpointError,
    ConfigError,
    GenerationExistsError,
    ManifestError,
    StorageError,
)
from lightning_async_ckpt.storage import inflight, multipart, retention
from lightning_async_ckpt.storage.backend import backend_for, open_filesystem
from lightning_async_ckpt.storage.generation import (
    GenerationInfo,
    GenerationState,
    Listing,
    Skipped,
    VerifyResult,
    generation_name,
    parse_generation_name,
)
from lightning_async_ckpt.storage.io import (
    DEFAULT_CHECKSUM,
    Checksum,
    crc32c_module,
    fsync_dir,
)
from lightning_async_ckpt.storage.ledger import Ledger
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.reading import StoreReading
from lightning_async_ckpt.storage.root import StoreRoot
from lightning_async_ckpt.storage.writer import GenerationWriter, claim_step

# Old private names, kept while callers move to the public ones in ``storage.io``.
_Checksum = Checksum
_fsync_dir = fsync_dir

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


class CheckpointStore(StoreReading):
    """Generations of checkpoint objects under one fsspec URL.

    Thread-safety: listing, reading and ``gc`` may run on any thread; each :class:`GenerationWriter` is used by
    one thread at a time. Generations being written by this store are never touched by ``gc``.

    Args:
        uri: A local path, ``file://``, ``memory://``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: Passed to the fsspec filesystem (e.g. ``{"endpoint_url": ...}`` for S3).
        run_id: Identifier recorded in manifests and writer claims; ``gc`` only removes this run's generations
            unless told otherwise. Default: a new random id.
        checksum: ``"crc32c"`` (default where ``google-crc32c`` or ``crc32c`` is installed, several GB/s), ``"crc32"``
            (zlib) or ``"sha256"``.
        block_size: Multipart block size for object stores, in bytes (default 32 MiB).
        check_writable: Probe the location at construction: local and memory are written to; an object store's
            bucket must exist and be listable.
        direct_io: On local disks, write data objects with ``O_DIRECT`` where the filesystem supports it
            (bypassing the page cache keeps checkpoint writes from stalling training); falls back to buffered
            writes elsewhere.
        hashed_prefixes: Sharded (DCP) saves write each rank's data files under ``<root>/spread/<h>/step-N/``
            (16 hashed key prefixes, recorded in the manifest) instead of ``step-N/``, so that many ranks do not all
            write into one new prefix; readers follow the manifest (``docs/storage.md`` has the trade-off).

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
        hashed_prefixes: bool = False,
    ) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise ConfigError(f"uri must be a non-empty path or URL string, got {uri!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        checksum = checksum or DEFAULT_CHECKSUM
        if checksum not in ("crc32c", "crc32", "sha256"):
            raise ConfigError(f"checksum must be 'crc32c', 'crc32' or 'sha256', got {checksum!r}")
        if checksum == "crc32c" and crc32c_module() is None:
            raise ConfigError("checksum 'crc32c' needs the google-crc32c package: pip install google-crc32c")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 5 << 20):
            raise ConfigError(f"block_size must be an int of at least 5 MiB (S3's part minimum), got {block_size!r}")
        if run_id is not None and not isinstance(run_id, str):
            raise ConfigError(f"run_id must be a string or None (a new random id), got {run_id!r}")
        if not isinstance(check_writable, bool):
            raise ConfigError(f"check_writable must be True or False, got {check_writable!r}")
        if not isinstance(direct_io, bool):
            raise ConfigError(f"direct_io must be True or False, got {direct_io!r}")
        if not isinstance(hashed_prefixes, bool):
            raise ConfigError(f"hashed_prefixes must be True or False, got {hashed_prefixes!r}")
        self.direct_io = direct_io
        self.hashed_prefixes = hashed_prefixes
        self.uri = uri
        self.storage_options = dict(storage_options or {})
        self.run_id = run_id or self.new_run_id()
        self.checksum = checksum
        fs, root = open_filesystem(uri, self.storage_options)
        self.location = StoreRoot(
            uri,
            self.storage_options,
            fs,
            root.rstrip("/") or "/",
            backend_for(fs, block_size),
            checksum,
            direct_io=direct_io,
            hashed_prefixes=hashed_prefixes,
        )
        self.fs = fs
        self.root = self.location.root
        self.backend = self.location.backend
        self.is_local = self.location.is_local
        self._lock = threading.Lock()
        self._writing: set[int] = set()
        self.ledger = Ledger()  # what retention knows between passes (reads O(1) manifests per save)
        # Aborts S3 multipart uploads that killed writers left open (from begin and retain; nothing elsewhere).
        self.upload_sweeper = multipart.Sweeper()
        if check_writable:
            self.backend.check_writable(self.root, uri)

    @staticmethod
    def new_run_id() -> str:
        """A fresh random run id."""
        return uuid.uuid4().hex[:12]

    # -- writing -----------------------------------------------------------------------------------------
    def begin(self, step: int) -> GenerationWriter:
        """Start writing the generation for ``step``: claim it, or write under a private prefix.

        A torn manifest (never recoverable) is removed. If another writer claims the step (alive, or crashed
        on another host), this writer's objects go under ``w-<token>/`` so neither overwrites the other; the
        exclusive manifest decides which commits. On S3, multipart uploads that killed writers left open under this
        store are aborted first (:mod:`.multipart`: on the first ``begin``, then at most every 10 minutes).

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
            self.invalidate_cache()
            path = self.generation_path(step)
            if self._holds_manifest(step, f"{path}/{MANIFEST_NAME}"):
                raise GenerationExistsError(
                    f"generation step {step} is already committed at {self.url(step)}; committed checkpoints are "
                    "never overwritten: use another dirpath, or remove it with `lightning-async-ckpt gc`"
                )
            self.upload_sweeper.maybe(self.location)
            return claim_step(self, step)
        except GenerationExistsError:
            self.end_write(step)
            raise
        except Exception as exc:
            self.end_write(step)
            try:
                self.backend.remove_folder_if_empty(self.generation_path(step))
            except Exception:  # noqa: BLE001 - the preparation's own error is the one to report
                pass
            raise StorageError(f"could not prepare generation {self.url(step)}: {exc}") from exc

    def _holds_manifest(self, step: int, manifest_path: str) -> bool:
        """Whether ``step`` has a manifest that must not be overwritten (valid, or from a newer format version).

        A manifest that cannot be parsed (a torn write on a filesystem without atomic puts) never made the
        generation recoverable: it is removed, so the step can be committed.
        """
        info = self._read_generation(step)
        if info.unreadable:
            raise StorageError(f"cannot tell whether step {step} is committed: {info.error}")
        if info.holds_step:
            return True
        if info.error:
            _log.warning("generation %s has a corrupt manifest and was never recoverable (%s)", info.path, info.error)
            self.fs.rm_file(manifest_path)
        return False

    def end_write(self, step: int, *, owns_folder: bool = True) -> None:
        """Release this store's in-process hold on ``step`` (a writer's commit and abort call it).

        ``owns_folder=False`` for an attempt written under its own prefix beside files it did not write: the step
        folder is then not this store's leftover, so retention never removes it whole (foreign files stay).
        """
        with self._lock:
            self._writing.discard(step)
        if owns_folder:
            self.ledger.wrote(step)  # what a failed attempt leaves is this library's, claims or not (retention.py)

    _end_write = end_write  # old private name, kept for callers that have not moved yet

    def writing(self) -> frozenset[int]:
        """Steps this store is writing now."""
        with self._lock:
            return frozenset(self._writing)

    # -- resuming ----------------------------------------------------------------------------------------
    def resume(self, step: int | None = None, *, verify: bool = True) -> GenerationInfo | None:
        """The generation to resume from, and continue its run: this store's run id becomes the generation's.

        Retention (``keep_last``) counts and removes only this store's run's generations, so that a second writer
        in the same folder never deletes what it did not write. A restarted process is a new store with a new run
        id: reading the newest generation with :meth:`latest` alone would leave the earlier process's generations
        to nobody (``keep_last=3`` kept 6 after one restart). Resuming through this method makes the new process
        the same run, so its commits retire the generations it resumed from.

        Args:
            step: Resume from this committed step; default the newest intact one (see :meth:`latest`).
            verify: Check checksums of the returned generation (reads it once).

        Returns:
            The generation (read it with :meth:`open`), or ``None`` when the store was listed and holds no intact
            committed generation; the run id is then left as it was.

        Raises:
            CheckpointError: This store is writing a generation already (change runs before the first save).
            StoreUnavailableError: The location cannot be listed.
            ManifestError: ``step`` is not committed, or (with ``verify``) fails its checksums.
        """
        if self.writing():
            raise CheckpointError(
                f"resume() while this store writes steps {sorted(self.writing())}: call it before the first save"
            )
        if step is None:
            info = self.latest(verify=verify)
        else:
            inflight.wait_for(self.uri, self.storage_options, doing=f"resume(step={step})")
            info = self._read_generation(step)
            if not info.committed:
                raise ManifestError(f"generation step {step} at {self.url(step)} is not committed ({info.error})")
            problems = self.verify(step, manifest=info.manifest).problems if verify else self.check_sizes(info.manifest)
            if problems:
                raise ManifestError(f"generation step {step} at {self.url(step)} is damaged: {'; '.join(problems)}")
        if info is not None and info.run_id:
            if info.run_id != self.run_id:
                _log.info("continuing run %s (resumed from step %d at %s)", info.run_id, info.step, info.path)
            self.run_id = info.run_id
        return info

    # -- retention ---------------------------------------------------------------------------------------
    def retain(
        self,
        keep_last: int,
        *,
        all_runs: bool = False,
        dry_run: bool = False,
        verify: bool | None = None,
        min_leftover_age_s: float = 0.0,
        protect: frozenset[int] = frozenset(),
        generations: list[GenerationInfo] | None = None,
    ) -> retention.RetentionReport:
        """Apply retention and report ``removed``, ``failed`` and ``refused`` (rules: :mod:`.retention`).

        Args:
            keep_last: How many verified complete committed generations to keep (at least 1).
            all_runs: Act for every run in the folder (the operator), not only this store's run.
            dry_run: Only plan; ``removed`` lists what would be removed.
            verify: Which kept generations get their checksums verified before they count: ``True`` all,
                ``None`` (default) those up to 64 MiB, ``False`` none (sizes only, what ``gc`` does after a commit:
                the new generation's checksums were computed as it was written).
            min_leftover_age_s: With ``all_runs``, leave other runs' uncommitted leftovers younger than this.
            protect: Steps kept whatever their age (``gc --keep-best``: the best-k generations by score).
            generations: This folder's ``generations(include_uncommitted=True)``, just read: not listed again.

        Unless ``dry_run``, S3 multipart uploads left open by killed writers are aborted first (:mod:`.multipart`;
        always with ``all_runs``, else at most every 10 minutes); ``upload_sweeper.last`` reports it.
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(
                f"keep_last must be an int >= 1 (the newest committed generation is kept), got {keep_last!r}"
            )
        if not dry_run:
            self.upload_sweeper.maybe(self.location, force=all_runs)  # before retention removes the claims it reads
        return retention.execute(
            self,
            keep_last,
            all_runs=all_runs,
            dry_run=dry_run,
            verify=verify,
            min_leftover_age_s=min_leftover_age_s,
            protect=protect,
            generations=generations,
        )

    def gc(
        self, keep_last: int, *, all_runs: bool = False, dry_run: bool = False, verify: bool | None = False
    ) -> list[int]:
        """Delete old generations and return the steps removed (or that would be); see :meth:`retain`.

        Sizes only by default: it runs after every commit, and must not re-read generations each time.
        """
        return self.retain(keep_last, all_runs=all_runs, dry_run=dry_run, verify=verify).removed

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, run_id={self.run_id!r})"
