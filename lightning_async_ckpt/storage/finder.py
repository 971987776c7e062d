"""Finding generations without reading every manifest: one listing of names, then manifests newest first.

A generation's step is in its folder name (``step-NNNNNNNN``), so a listing alone orders the generations; the
newest intact one costs one manifest read (plus its verification) when it is intact, whatever the number of
generations. Older manifests are read only while newer ones fail (uncommitted, torn, another run's, damaged).

:func:`list_steps` is the one listing (it raises when the location cannot be listed, so "no checkpoint" is only
ever said of a fresh listing that holds none); :func:`newest_first` reads manifests lazily, newest step first;
:func:`newest_intact` picks across ``dirpath`` and its version folders (``v1``, ``v2``, ... written by re-runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import StoreUnavailableError
from lightning_async_ckpt.storage.generation import VERSION_RE, GenerationInfo, Skipped, parse_generation_name
from lightning_async_ckpt.storage.manifest import Manifest

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["Found", "StepListing", "list_steps", "newest_first", "newest_intact"]


@dataclass(frozen=True)
class StepListing:
    """One listing of a store's folder, before any manifest is read.

    Attributes:
        steps: Steps of the canonical generation folders, ascending.
        skipped: Entries not read as generations, with the reason.
        versions: Numbers of the version folders (``v1`` is 1), ascending.
    """

    steps: list[int] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Found:
    """The generation :func:`newest_intact` chose: the store holding it and its verified manifest."""

    store: CheckpointStore
    info: GenerationInfo
    version: int

    @property
    def manifest(self) -> Manifest:
        """The generation's manifest."""
        assert self.info.manifest is not None
        return self.info.manifest


def list_steps(store: CheckpointStore) -> StepListing:
    """List ``store``'s folder once (names only; no manifest is read).

    Raises:
        StoreUnavailableError: The location cannot be listed (missing bucket, unreachable endpoint, no
            permission). A local folder that does not exist yet lists as empty.
    """
    store.invalidate_cache()
    try:
        entries = store.fs.ls(store.root, detail=True)
    except FileNotFoundError as exc:
        why = store.backend.missing_root_error(store.root)
        if why is None:
            return StepListing()
        raise StoreUnavailableError(f"cannot list {store.uri!r}: {why}") from exc
    except Exception as exc:
        raise StoreUnavailableError(f"could not list {store.uri!r}: {type(exc).__name__}: {exc}") from exc
    steps, skipped, versions = [], [], []
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        is_folder = entry.get("type") in ("directory", None)
        version = VERSION_RE.match(name)
        if version and is_folder:
            versions.append(int(version.group(1)))
            continue
        step = parse_generation_name(name)
        if step is None:
            if name.startswith("step-"):
                skipped.append(Skipped(name, "not a canonical generation name (step- and 8+ ASCII digits)"))
            continue
        if not is_folder:
            skipped.append(Skipped(name, f"a {entry.get('type')}, not a folder"))
            continue
        if not store.backend.inside(store.generation_path(step), store.root):
            skipped.append(Skipped(name, "resolves outside the store root (symlink)"))
            continue
        steps.append(step)
    return StepListing(sorted(steps), sorted(skipped, key=lambda s: s.name), sorted(versions))


def newest_first(store: CheckpointStore, steps: Iterable[int]) -> Iterator[GenerationInfo]:
    """Read the manifests of ``steps`` one at a time, newest step first (a caller that stops reads no more)."""
    for step in sorted(steps, reverse=True):
        yield store.read_generation(step)


def newest_intact(
    dirpath: str,
    storage_options: dict[str, Any] | None,
    *,
    accept: Callable[[Manifest], bool],
    on_skip: Callable[[str, tuple[str, ...]], None],
) -> Found | None:
    """The most recently committed intact generation of ``dirpath`` and its version folders that ``accept`` takes.

    Within one folder generations rank by step (a re-run that would not continue a folder's run writes to a new
    version); across folders the newest ``committed_at`` wins (ties: higher version, then step). ``dirpath`` is
    listed once and each version folder once; manifests are read newest first, so an intact newest generation
    costs one manifest read and its verification (every object re-read against its checksum), at any number of
    generations. One that fails verification is reported to ``on_skip`` with its problems and the next is tried.

    Raises:
        StoreUnavailableError: ``dirpath`` or a version folder cannot be listed.
    """
    from lightning_async_ckpt.storage.store import CheckpointStore

    root = CheckpointStore(dirpath, storage_options, check_writable=False)
    listing = list_steps(root)
    heads: dict[int, tuple[CheckpointStore, Iterator[GenerationInfo], GenerationInfo | None]] = {}
    places = [(0, root, listing.steps)]
    for version in listing.versions:
        uri = f"{dirpath.rstrip('/')}/v{version}"
        store = CheckpointStore(uri, storage_options, check_writable=False)
        places.append((version, store, list_steps(store).steps))
    for version, store, steps in places:
        infos = (i for i in newest_first(store, steps) if i.manifest is not None and accept(i.manifest))
        heads[version] = (store, infos, next(infos, None))
    while True:
        live = [(v, h) for v, h in heads.items() if h[2] is not None]
        if not live:
            return None
        version, (store, infos, info) = max(
            live,
            key=lambda vh: (vh[1][2].manifest.committed_at, vh[0], vh[1][2].step),  # type: ignore[union-attr]
        )
        assert info is not None and info.manifest is not None
        result = store.verify(info.step, manifest=info.manifest)
        if result.ok:
            return Found(store, info, version)
        on_skip(store.url(info.step), result.problems)
        heads[version] = (store, infos, next(infos, None))
