"""Finding generations without reading every manifest: one listing of names, then manifests newest first.

A generation's step is in its folder name (``step-NNNNNNNN``), so a listing alone orders the generations; the
newest intact one costs one manifest read (plus its verification) when it is intact, whatever the number of
generations. Older manifests are read only while newer ones fail (uncommitted, torn, another run's, damaged).

Which generation is "latest" never depends on a clock: within one folder generations rank by step (a run only
continues a folder where no newer step exists, so a higher step was written later); across ``dirpath`` and its
version folders (``v1``, ``v2``, ..., each created by a later placement of a run, :mod:`lightning.rerun`) the
highest version holding an acceptable generation wins. ``committed_at`` is the writer's wall clock and is only shown.

Readers race retention: a writer with ``keep_last=1`` removes the generation a reader has just listed (manifest
first, then data). When the generation a walk chose vanishes under it, or a walk ends with nothing while some listed
folder had no manifest, the folder is listed again (at most :data:`RELISTS` times): "no checkpoint" is only said
when two walks over the same listing saw the same thing, so a commit that retired what a reader listed is found.

:func:`list_steps` is the one listing (it raises when the location cannot be listed, and names non-regular entries
such as a FIFO without opening them); :func:`newest_in` finds one folder's newest acceptable intact generation;
:func:`~.lookup.newest_intact` picks across ``dirpath`` and its version folders.
"""

from __future__ import annotations

import logging
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import StorageError, StoreUnavailableError
from lightning_async_ckpt.storage.generation import (
    VERSION_RE,
    GenerationInfo,
    Skipped,
    parse_generation_name,
)
from lightning_async_ckpt.storage.regular import describe_mode

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.root import StoreRoot

__all__ = [
    "RELISTS",
    "StepListing",
    "describe_entry",
    "list_steps",
    "manifest_gone",
    "newest_committed_above",
    "newest_first",
    "newest_in",
    "warn_skip",
]

_log = logging.getLogger("lightning_async_ckpt")

#: How many times a reader lists a folder again while generations vanish under it (retention of a live writer).
RELISTS = 32


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


def describe_entry(entry: dict[str, Any]) -> str:
    """What a listed entry is, in words (``"a FIFO (named pipe)"``, ``"a file"``), from its stat mode when known."""
    mode = entry.get("mode")
    if isinstance(mode, int) and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        return describe_mode(mode)
    kind = entry.get("type")
    return "a file" if kind == "file" else f"a {kind or 'non-folder'} entry"


def list_steps(store: StoreRoot) -> StepListing:
    """List ``store``'s folder once (names only; no manifest is read, no entry is opened).

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
            elif entry.get("type") not in ("directory", "file", None):
                skipped.append(Skipped(name, f"{describe_entry(entry)}, not a regular file or folder: not opened"))
            continue
        if not is_folder:
            skipped.append(Skipped(name, f"{describe_entry(entry)}, not a folder: not opened"))
            continue
        if not store.backend.inside(store.generation_path(step), store.root):
            skipped.append(Skipped(name, "resolves outside the store root (symlink)"))
            continue
        steps.append(step)
    return StepListing(sorted(steps), sorted(skipped, key=lambda s: s.name), sorted(versions))


def newest_committed_above(stores: Iterable[StoreRoot], step: int | None) -> int | None:
    """The newest step above ``step`` that one of ``stores`` (a durable tier and its version folders) holds with a
    committed manifest, or ``None``. One listing per store; only manifests of steps listed above ``step`` are read
    (none when nothing newer is listed), newest first: a folder without a manifest (a promotion killed mid-copy)
    is not a generation and never outranks a committed one of the other tier.

    Raises:
        StoreUnavailableError: A store cannot be listed.
    """
    listed = [(s, store) for store in stores for s in list_steps(store).steps if step is None or s > step]
    for s, store in sorted(listed, key=lambda item: item[0], reverse=True):
        if store.read_generation(s).committed:
            return s
    return None


def newest_first(store: StoreRoot, steps: Iterable[int]) -> Iterator[GenerationInfo]:
    """Read the manifests of ``steps`` one at a time, newest step first (a caller that stops reads no more)."""
    for step in sorted(steps, reverse=True):
        yield store.read_generation(step)


def manifest_gone(store: StoreRoot, step: int) -> bool:
    """Whether generation ``step`` has no manifest now (retired, or never committed)."""
    info = store.read_generation(step)
    return not info.committed and info.error is None and not info.unreadable


def newest_in(
    store: StoreRoot,
    *,
    accept: Callable[[GenerationInfo], bool],
    check: Callable[[GenerationInfo], tuple[str, ...]],
    on_skip: Callable[[str, tuple[str, ...]], None],
    report_rejected: bool = False,
    listing: StepListing | None = None,
) -> GenerationInfo | None:
    """The newest generation of ``store`` that ``accept`` takes and ``check`` finds intact, or ``None``.

    Manifests are read newest step first; one that ``check`` (a verification returning problems) fails is reported
    to ``on_skip`` once and the next older is tried, unless its manifest vanished meanwhile (retired by a writer's
    retention): then, as when a walk ends with nothing while a listed folder had no manifest, the folder is listed
    again (see the module docstring). ``None`` only when two walks over one listing saw the same generations.
    ``report_rejected``: also report manifests that are rejected (torn, hostile). ``listing``: the folder's listing,
    just taken (the first walk uses it instead of listing again).

    Raises:
        StoreUnavailableError: The folder cannot be listed.
        StorageError: Generations kept vanishing through :data:`RELISTS` listings (retention outran the reader).
    """
    previous: tuple[Any, ...] | None = None
    reported: set[int] = set()
    for _ in range(RELISTS):
        steps = (listing or list_steps(store)).steps
        listing = None
        seen: list[tuple[int, str]] = []
        for info in newest_first(store, steps):
            if not info.committed or info.manifest is None:
                seen.append((info.step, "uncommitted" if info.error is None and not info.unreadable else "rejected"))
                if report_rejected and info.error and info.step not in reported:
                    reported.add(info.step)
                    on_skip(info.path, (info.error,))
                continue
            if not accept(info):
                seen.append((info.step, "not accepted"))
                continue
            problems = check(info)
            if not problems:
                return info
            if manifest_gone(store, info.step):
                seen.append((info.step, "vanished"))  # retired while being read: never reported as damage
                continue
            seen.append((info.step, "damaged"))
            if info.step not in reported:
                reported.add(info.step)
                on_skip(info.path, problems)
        if not any(what in ("uncommitted", "vanished") for _, what in seen):
            return None  # every listed generation has a lasting reason: nothing vanished under this walk
        signature = (tuple(steps), tuple(seen))
        if signature == previous:
            return None
        previous = signature
    raise StorageError(
        f"{store.uri}: generations kept vanishing while they were read ({RELISTS} listings): a writer's retention "
        "removed each generation this reader chose; try again"
    )


def warn_skip(url: str, problems: tuple[str, ...]) -> None:
    """The default ``on_skip``: a warning naming the generation and its problems."""
    warnings.warn(f"skipping generation {url}: {'; '.join(problems)}", stacklevel=4)
