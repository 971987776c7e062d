"""The one cross-tier resume: which step, which tier, for every entry point (docs/tiers.md, "Resuming across tiers").

1. each rank finds the newest intact generation of its own local tier that its layout accepts (:class:`LocalTier`),
   of this run lineage (:func:`this_lineage`); a damaged one is skipped with a warning;
2. the ranks agree on the oldest of those steps, each rank above it looking again at or below it
   (:func:`pick_local`); with peer replicas the newest step any rank holds wins and a rank lacking it receives it
   from a peer (:func:`pick_with_peers`);
3. the local step wins unless the durable tier holds a newer **committed** generation; otherwise every rank resumes
   from the durable tier together.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_async_ckpt.core.collective import Collective, agree
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.finder import list_steps, newest_committed_above
from lightning_async_ckpt.storage.lookup import newest_intact
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.root import StoreRoot, comparable_path
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.promote import DURABLE_TIER_KEY, PROMOTED_FROM_KEY
from lightning_async_ckpt.tiers.replicas import restore_from_peers

__all__ = [
    "Local",
    "LocalTier",
    "OneStream",
    "durable_roots",
    "keeps_local",
    "pick_local",
    "pick_with_peers",
    "lineage_filter",
    "this_lineage",
    "version_store",
]

_log = logging.getLogger("lightning_async_ckpt")


class LocalTier(Protocol):
    """What one rank's local tier holds, in its layout."""

    def newest(self, ceiling: int | None) -> tuple[int, int] | None:
        """``(version, step)`` of this rank's newest intact accepted generation at or below ``ceiling`` (``None``:
        any step), or ``None``."""
        ...

    def store(self, version: int) -> CheckpointStore:
        """Where this rank reads a generation of local version folder ``version``."""
        ...


@dataclass(frozen=True)
class Local:
    """The local generation every rank resumes from.

    Attributes:
        step: The agreed step (the same on every rank).
        version: This rank's version folder holding it.
        store: This rank's store holding it.
        beaten_by: The newer step committed on the durable tier (every rank then resumes from there, unless its
            newest verified generation is older than ``step``), or ``None``: this generation wins.
    """

    step: int
    version: int
    store: CheckpointStore
    beaten_by: int | None = None


def version_store(local_dirpath: str, version: int, storage_options: dict[str, Any] | None = None) -> CheckpointStore:
    """The store of version folder ``version`` of ``local_dirpath`` (``0``: ``local_dirpath`` itself)."""
    uri = f"{local_dirpath.rstrip('/')}/v{version}" if version else local_dirpath
    return CheckpointStore(uri, storage_options, check_writable=False)


def durable_roots(durable: CheckpointStore) -> list[StoreRoot]:
    """Where the durable tier and its version folders live (listed, nothing read)."""
    root = durable.location
    versions = list_steps(root).versions
    return [root, *(version_store(durable.uri, v, durable.storage_options).location for v in versions)]


def _warn_skipped(url: str, problems: tuple[str, ...]) -> None:
    """Warn (log and ``warnings``) that local generation ``url`` is skipped for ``problems``."""
    message = f"skipping local generation {url}: {'; '.join(problems)}"
    _log.warning("%s", message)
    warnings.warn(message, stacklevel=4)


@dataclass(frozen=True)
class OneStream:
    """A local tier of one-stream generations (one writer; ``<local_dirpath>[/v<k>]/step-<n>``).

    Attributes:
        local_dirpath: The local tier.
        durable: The durable tier: only generations of its run lineage count (:func:`this_lineage`).
        accept: Which committed generations the caller can load (its layout).
        step: Only this step (``load_state(step=...)``), or ``None``.
    """

    local_dirpath: str
    durable: CheckpointStore
    accept: Callable[[Manifest], bool] = lambda _: True
    step: int | None = None

    def newest(self, ceiling: int | None) -> tuple[int, int] | None:
        """See :meth:`LocalTier.newest` (``local_dirpath`` missing: ``None``).

        Raises:
            ConfigError: :func:`this_lineage`'s.
        """
        lineage = this_lineage(self.local_dirpath, self.durable)

        def accept(manifest: Manifest) -> bool:
            if self.step is not None and manifest.step != self.step:
                return False
            return (ceiling is None or manifest.step <= ceiling) and self.accept(manifest) and lineage(manifest)

        found = newest_intact(self.local_dirpath, None, accept=accept, on_skip=_warn_skipped)
        return None if found is None else (found.version, found.info.step)

    def store(self, version: int) -> CheckpointStore:
        """See :meth:`LocalTier.store`."""
        return version_store(self.local_dirpath, version)


def pick_local(
    tier: LocalTier, durable: CheckpointStore | None, *, collective: Collective | None = None, doing: str = "resuming"
) -> Local | None:
    """The newest local generation every rank holds intact, ``beaten_by`` the durable tier's newer committed step
    when it holds one; ``None`` when some rank holds none (every rank resumes from the durable tier). Collective
    over ``collective`` (``None``: this process alone); rank 0 of it lists ``durable`` and its version folders
    (``None``: an asked-for step, never outranked).

    Raises:
        RankFailedError: Another rank failed to look (its own error is raised there).
        StoreUnavailableError: ``durable`` or the local tier cannot be listed.
    """
    lead = collective is None or collective.rank == 0
    mine, error = None, None
    try:
        mine = tier.newest(None)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    steps = agree(collective, error, None if mine is None else mine[1], doing=f"{doing}: the local tiers' newest step")
    while True:
        if any(s is None for s in steps):
            if any(s is not None for s in steps):
                _log.warning("%s: rank(s) %s hold no local generation the others hold intact", doing, _lacking(steps))
            return None
        step = min(steps)
        beat, error = None, None
        try:
            if mine is not None and mine[1] != step:
                mine = tier.newest(step)
            beat = newest_committed_above(durable_roots(durable), step) if lead and durable is not None else None
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            error = exc
        answers = agree(collective, error, (beat, None if mine is None else mine[1]), doing=f"{doing}: step {step}")
        steps, beat = [s for _, s in answers], answers[0][0]
        if beat is not None or all(s == step for s in steps):
            break
    if mine is None or mine[1] != step:  # beaten before this rank came down to the agreed step
        return None
    if beat is not None:
        _log.info("%s: the durable tier holds step %d, newer than the local tier's %d", doing, beat, step)
    return Local(step, mine[0], tier.store(mine[0]), beat)


def keeps_local(local: Local | None, durable_step: int | None) -> bool:
    """Whether ``local`` is resumed from when the durable tier's newest verified step is ``durable_step``: it won, or
    the newer durable generation that beat it is damaged (the newest verified one is not newer)."""
    return local is not None and (local.beaten_by is None or durable_step is None or durable_step <= local.step)


def pick_with_peers(
    group: Any, tier: OneStream, durable: CheckpointStore | None, *, collective: Collective | None = None
) -> Local | None:
    """:func:`pick_local` with peer replicas (collective over the replicas' gloo ``group``): the newest step any
    rank holds intact, received from a peer into each folder that lacks it
    (:func:`~lightning_async_ckpt.tiers.replicas.restore_from_peers`; committed in the background: read its manifest
    with :func:`~lightning_async_ckpt.tiers.replica_persist.manifest_of`), unless the durable tier holds a newer
    committed one; ``None``: every rank resumes from the durable tier. ``collective``: where a failed look is raised
    on every rank first (the replicas' group would wait for a failed rank forever).

    Raises:
        ReplicaError: A copy from a peer failed (on every rank).
        StoreUnavailableError: ``durable`` or the local tier cannot be listed.
    """
    mine, beat, error = None, None, None
    try:
        mine = tier.newest(None)
        beat = None if mine is None or durable is None else newest_committed_above(durable_roots(durable), mine[1])
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    agree(collective, error, doing="resuming: the local tiers' newest step")
    agreed = restore_from_peers(
        group, tier.local_dirpath, newest_local=mine, durable_step=beat, newest_store=tier.store, background=True
    )
    if agreed is None:
        _log.info("resuming: no rank holds a local generation as new as the durable tier's newest committed one")
        return None
    _log.info("resuming: every rank resumes from its local tier, step %d", agreed[1])
    return Local(agreed[1], agreed[0], tier.store(agreed[0]))


def this_lineage(local_dirpath: str, durable: CheckpointStore) -> Callable[[Manifest], bool]:
    """Which committed local generations belong to the run that resumes (:func:`lineage_filter` over the run ids of
    the one-stream local tier's committed generations).

    Raises:
        ConfigError: :func:`lineage_filter`'s.
    """
    root = CheckpointStore(local_dirpath, check_writable=False)
    stores = [root, *(version_store(local_dirpath, v) for v in list_steps(root.location).versions)]
    runs = {
        g.manifest.run_id
        for store in stores
        for g in store.scan(include_uncommitted=False).generations
        if g.committed and g.manifest is not None
    }
    return lineage_filter(runs, local_dirpath, durable)


def lineage_filter(runs: Collection[str], local_dirpath: str, durable: CheckpointStore) -> Callable[[Manifest], bool]:
    """Which committed local generations belong to the run that resumes, given the ``runs`` the local tier holds
    generations of. A generation that names its durable tier (:data:`DURABLE_TIER_KEY`, written at each local save)
    counts only when that is ``durable`` or one of its version folders, and not one older than the newest version
    holding a committed generation (the run ``ckpt_path="last"`` resumes without a local tier: a fresh run written
    beside an earlier one, ``<dirpath>/v1``, is never outranked by the earlier run's newer local steps). Beyond that:
    all of them while the local tier holds one run's (nothing read from ``durable`` unless it has version folders);
    when it holds several runs' (a shared ``local_dirpath``), the run of the newest generation of ``durable``'s
    newest version holding one (the run it was promoted from), so one run never resumes another's.

    Raises:
        ConfigError: Several runs' generations and ``durable`` names none of them: this run cannot tell its own.
    """
    # One place, however spelled: a local disk's root resolved (".." and "//" folded, symlinks followed), as
    # check_apart compares the tiers; a durable tier spelled another way at resume must still find its generations.
    place = comparable_path if durable.is_local else (lambda path: path.rstrip("/"))
    runs, tier = set(runs), place(durable.root)

    newest, info = _newest_version(durable)

    def of_durable(manifest: Manifest) -> bool:
        named = manifest.extra.get(DURABLE_TIER_KEY)
        if named is None:
            return True
        named = place(str(named))
        found = re.fullmatch(re.escape(tier) + r"(?:/v(\d+))?", named)
        return found is not None and int(found.group(1) or 0) >= newest

    if len(runs) <= 1:
        return of_durable
    info = info if info is not None else durable.latest(verify=False)
    ours = set() if info is None or info.manifest is None else {info.manifest.run_id}
    if info is not None and info.manifest is not None:
        ours.add(str(info.manifest.extra.get(PROMOTED_FROM_KEY, {}).get("run_id", "")))
    if not ours & runs:
        raise ConfigError(
            f"local_dirpath {local_dirpath!r} holds generations of {len(runs)} runs ({', '.join(sorted(runs))}) and "
            f"the durable tier {durable.uri!r} names none of them, so this run cannot tell its own: give each run its "
            "own local_dirpath (e.g. one folder per run name), or remove the other runs' generations"
        )
    return lambda manifest: manifest.run_id in ours and of_durable(manifest)


def _newest_version(durable: CheckpointStore) -> tuple[int, Any]:
    """The newest version of ``durable`` holding a committed generation (``0``: ``durable`` itself, or none) and that
    version's newest committed generation, or ``None`` (none, or ``durable`` has no version folders: then only
    listed, no manifest read)."""
    versions = list_steps(durable.location).versions
    for version in sorted(versions, reverse=True):
        info = version_store(durable.uri, version, durable.storage_options).latest(verify=False)
        if info is not None:
            return version, info
    return 0, (durable.latest(verify=False) if versions else None)


def _lacking(steps: list[int | None]) -> list[int]:
    return [rank for rank, s in enumerate(steps) if s is None]
