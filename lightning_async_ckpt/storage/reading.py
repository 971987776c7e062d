"""The reading half of the checkpoint store: paths, listing, the one manifest reader, verification, the newest.

:class:`StoreReading` is what :class:`~lightning_async_ckpt.storage.store.CheckpointStore` does without a run: it
lists generations, reads and validates manifests (size-capped), verifies objects and finds the newest intact
generation, from the store's :class:`~.root.StoreRoot` alone. The store adds what belongs to a run on top of it:
writing, resuming (the run id) and retention.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.storage import finder, inflight, verification
from lightning_async_ckpt.storage.backend import Backend
from lightning_async_ckpt.storage.generation import GenerationInfo, Listing, VerifyResult
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry
from lightning_async_ckpt.storage.root import StoreRoot

__all__ = ["StoreReading"]


class StoreReading:
    """Listing, reading and verifying the generations under one location (the store's base; thread-safe).

    Attributes:
        uri: The location's URL as given.
        storage_options: The fsspec options it was opened with.
        location: Where the store lives (filesystem, root, backend).
        fs: The fsspec filesystem.
        backend: What differs per filesystem.
    """

    uri: str
    storage_options: dict[str, Any]
    location: StoreRoot
    fs: Any
    backend: Backend

    # -- paths -------------------------------------------------------------------------------------------
    def generation_path(self, step: int) -> str:
        """Path of generation ``step``'s folder on the store's filesystem (no protocol)."""
        return self.location.generation_path(step)

    _gen_path = generation_path  # old private name

    def url(self, step: int, name: str | None = None) -> str:
        """Full URL (with protocol) of a generation folder, or of ``name``'s default location in it."""
        return self.location.url(step, name)

    def object_url(self, step: int, name: str) -> str:
        """Full URL of object ``name`` of committed generation ``step``, where its manifest says it is."""
        return self.backend.url(self._object_path(step, self._entry(self.manifest(step), name)))

    # -- reading -----------------------------------------------------------------------------------------
    def scan(self, include_uncommitted: bool = True) -> Listing:
        """List generations and name every entry skipped (a non-canonical name, a file where a folder belongs).

        Raises:
            StoreUnavailableError: The location cannot be listed (missing bucket, unreachable endpoint, no
                permission). A local folder that does not exist yet lists as empty.
        """
        listing = finder.list_steps(self.location)
        found = [info for info in map(self.read_generation, listing.steps) if info.committed or include_uncommitted]
        return Listing(found, listing.skipped)

    def generations(self, include_uncommitted: bool = False) -> list[GenerationInfo]:
        """List generations sorted by step (see :meth:`scan` for what is skipped and the errors).

        Args:
            include_uncommitted: Also list folders without a valid manifest (``committed=False``).
        """
        return self.scan(include_uncommitted).generations

    def read_generation(self, step: int) -> GenerationInfo:
        """The one manifest reader: size-capped, validated, its step checked against the folder's."""
        return self.location.read_generation(step)

    _read_generation = read_generation  # old private name

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
        return verification.object_path(self.location, step, obj)

    def check_sizes(self, manifest: Manifest) -> list[str]:
        """Return problems with the objects' existence, location, kind and sizes (empty when all match)."""
        return verification.stat_objects(self.location, manifest)[0]

    def latest(self, *, verify: bool = True, run_id: str | None = None) -> GenerationInfo | None:
        """The newest committed generation that is intact, for resuming.

        With ``verify`` (the default) every object of the returned generation was re-read once and matched its
        checksum; without it (for listings) sizes only. A generation that fails is skipped with a warning, so a
        damaged newest generation falls back to the newest intact one. The folder is listed once and manifests are
        read newest step first (:mod:`.finder`): an intact newest generation costs one manifest read.

        Args:
            verify: Check checksums (reads every byte of the returned generation once).
            run_id: Only consider generations of this run.

        Saves this process has in flight here end first (bounded and logged, :func:`.inflight.wait_for`).

        A generation removed while it is read (a writer's retention) is neither reported nor skipped as damaged: the
        folder is listed again (bounded), so ``None`` means a fresh listing holds no intact committed generation.

        Raises:
            StoreUnavailableError: The location cannot be listed (never reported as "no checkpoint").
            StorageError: Generations kept vanishing under the reader through every relisting.
            CheckpointError: A save of this process was still in flight here after the bounded wait.
        """
        inflight.wait_for(self.uri, self.storage_options, doing="latest()")

        def check(info: GenerationInfo) -> tuple[str, ...]:
            assert info.manifest is not None
            if verify:
                return self.verify(info.step, manifest=info.manifest).problems
            return tuple(self.check_sizes(info.manifest))

        # One listing, then manifests newest first; listed again when what it chose vanished (retention).
        return finder.newest_in(
            self.location,
            accept=lambda info: run_id is None or info.run_id == run_id,
            check=check,
            on_skip=finder.warn_skip,
            report_rejected=True,
        )

    def verify(self, step: int, *, manifest: Manifest | None = None) -> VerifyResult:
        """Re-read every object of generation ``step`` once and check size and checksum; never unpickles.

        ``manifest``: the generation's manifest when the caller has just read it (not read again).
        """
        if manifest is None:
            try:
                manifest = self.manifest(step)
            except ManifestError as exc:
                return VerifyResult(step=step, ok=False, problems=(str(exc),))
        return verification.verify_generation(self.location, step, manifest)

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

    # -- helpers ---------------------------------------------------------------------------------------
    def invalidate_cache(self) -> None:
        """Drop the filesystem's listing cache, so the next listing sees what other processes wrote."""
        self.location.invalidate_cache()
