"""Resume of sharded (DCP) generations across two tiers: every rank agrees on one step and one tier.

A local sharded generation is usable only when **every** rank holds its own part intact. :func:`latest_across_tiers`
(collective) is the one cross-tier resume (:func:`~lightning_async_ckpt.tiers.resume.pick_local`) over
:class:`RankParts`; otherwise every rank falls back together to the durable store's newest verified generation.
Layout: ``<local_dirpath>[/v<k>]/rank-<r>``; a run that resumes from a step older than a local generation some rank
holds writes a new version folder (committed names are never rewritten).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from lightning_async_ckpt.core.collective import TorchCollective, agree
from lightning_async_ckpt.sharded.once import gloo_group, latest_once
from lightning_async_ckpt.sharded.spread import load_generation
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.local_tier import LOCAL_TIER_KEY, rank_store
from lightning_async_ckpt.tiers.resume import lineage_filter, pick_local

__all__ = [
    "RankParts",
    "TierChoice",
    "from_durable",
    "latest_across_tiers",
    "local_roots",
    "local_state",
    "part_problem",
    "parts_of",
    "version_root",
]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass(frozen=True)
class TierChoice:
    """The generation every rank resumes from.

    Attributes:
        step: The agreed step.
        tier: ``"local"`` (every rank reads its own local part) or ``"durable"``.
        store: The store this rank loads from (its own local store, or the durable store).
    """

    step: int
    tier: str
    store: CheckpointStore

    def load(self, state: dict[str, Any], **kwargs: Any) -> list[str]:
        """``dcp.load`` of the agreed generation into ``state`` in place, every object read verified (collective).

        Raises:
            ManifestError: An object this rank reads failed its size or checksum.
        """
        return load_generation(state, self.store, self.step, **kwargs)


def version_root(local_dirpath: str, version: int) -> str:
    """The folder of local version ``version`` (0: ``local_dirpath`` itself)."""
    root = local_dirpath.rstrip("/")
    return root if version == 0 else f"{root}/v{version}"


def local_roots(local_dirpath: str) -> list[int]:
    """The local version folders that exist (always including 0), ascending."""
    fs, path = fsspec.core.url_to_fs(local_dirpath)
    return [0, *version_folders(fs, path)]


def tier_runs(local_dirpath: str) -> set[str]:
    """The run ids of every committed generation this sharded local tier holds (own parts and peer replicas, every
    version folder): what :func:`~lightning_async_ckpt.tiers.resume.lineage_filter` decides on, once every rank's
    set is joined (all ranks keep the same lineage)."""
    runs: set[str] = set()
    for version in local_roots(local_dirpath):
        fs, root = fsspec.core.url_to_fs(version_root(local_dirpath, version))
        try:
            folders = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p)]
        except FileNotFoundError:
            continue
        for name in folders:
            scan = CheckpointStore(f"{version_root(local_dirpath, version)}/{name}", check_writable=False).scan()
            runs |= {g.manifest.run_id for g in scan.generations if g.committed and g.manifest is not None}
    return runs


def agreed_lineage(
    local_dirpath: str, durable: CheckpointStore, collective: Any, doing: str
) -> Callable[[Manifest], bool]:
    """The resuming run's lineage, the same on every rank: :func:`lineage_filter` over every rank's
    :func:`tier_runs` joined (collective over ``collective``; ``None``: this process alone).

    Raises:
        ConfigError: ``lineage_filter``'s, on every rank.
        RankFailedError: Another rank could not list its local tier or the durable tier (its error raised there).
    """
    runs, error = set(), None
    try:
        runs = tier_runs(local_dirpath)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    joined = set().union(*agree(collective, error, runs, doing=f"{doing}: the local tiers' runs"))
    keep, error = None, None
    try:
        keep = lineage_filter(joined, local_dirpath, durable)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    agree(collective, error, doing=f"{doing}: this run's lineage")
    assert keep is not None
    return keep


def local_state(
    local_dirpath: str, rank: int, world_size: int, keep: Callable[[Manifest], bool] | None = None
) -> tuple[dict[int, int], int, int | None]:
    """This rank's committed local steps (step -> version; with ``keep``, only those whose manifest it keeps: the
    resuming run's lineage, :func:`agreed_lineage`), its newest version, that version's newest step."""
    steps: dict[int, int] = {}
    per_version: dict[int, list[int]] = {}
    try:
        versions = local_roots(local_dirpath)
    except Exception as exc:  # noqa: BLE001 - an unreadable local tier is a missing one: durable is the truth
        _log.warning("rank %d: the local tier %s cannot be listed (%s): it is not used", rank, local_dirpath, exc)
        return {}, 0, None
    for version in versions:
        try:
            listed = rank_store(version_root(local_dirpath, version), rank).generations(include_uncommitted=True)
        except Exception as exc:  # noqa: BLE001 - as above
            _log.warning("rank %d: local version %d cannot be listed (%s): it is not used", rank, version, exc)
            continue
        per_version[version] = [info.step for info in listed]
        steps.update(dict.fromkeys(parts_of(listed, rank, world_size, keep), version))
    used = [v for v, listed in per_version.items() if listed]
    top = max(used, default=0)
    return steps, top, max(per_version.get(top, []), default=None)


def parts_of(
    listed: list[Any], rank: int, world_size: int, keep: Callable[[Manifest], bool] | None = None
) -> list[int]:
    """The steps of the generations ``listed`` that are committed parts of ``rank`` at ``world_size`` (with ``keep``,
    only those whose manifest it keeps: the resuming run's lineage, :func:`agreed_lineage`)."""
    mark = {"rank": rank, "world_size": world_size}
    return [
        i.step
        for i in listed
        if i.committed
        and i.manifest is not None
        and i.manifest.extra.get(LOCAL_TIER_KEY) == mark
        and (keep is None or keep(i.manifest))
    ]


def latest_across_tiers(local_dirpath: str, durable: CheckpointStore, *, verify: bool = True) -> TierChoice | None:
    """The newest generation every rank can load, from either tier (module docstring); collective.

    Call on every rank together (under ``torch.distributed``; one process works without a group).

    Raises:
        StoreUnavailableError: The durable store cannot be listed (on every rank).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    collective = None
    if distributed:
        collective = TorchCollective(None if str(dist.get_backend()) == "gloo" else gloo_group())
    keep = agreed_lineage(local_dirpath, durable, collective, "resuming sharded")
    parts = RankParts(local_dirpath, rank, world, verify, keep)
    local = pick_local(parts, durable, collective=collective, doing="resuming sharded")
    if local is not None and local.beaten_by is None:
        _log.info("resuming step %d from the local tier %s (every rank holds it intact)", local.step, local_dirpath)
        return TierChoice(local.step, "local", local.store)
    return from_durable(durable, verify=verify)


def from_durable(durable: CheckpointStore, *, verify: bool = True) -> TierChoice | None:
    """The durable tier's newest verified generation on every rank (rank 0 finds it; collective), or ``None``."""
    info = latest_once(durable, verify=verify)
    if info is None:
        return None
    _log.info("resuming step %d from the durable tier %s", info.step, durable.uri)
    return TierChoice(info.step, "durable", durable)


@dataclass(frozen=True)
class RankParts:
    """A local tier of DCP generations: this rank's own part of each, in ``<local_dirpath>[/v<k>]/rank-<r>``
    (a :class:`~lightning_async_ckpt.tiers.resume.LocalTier`)."""

    local_dirpath: str
    rank: int
    world_size: int
    verify: bool = True
    keep: Callable[[Manifest], bool] | None = None  # given: only the resuming run's lineage (agreed_lineage)

    def newest(self, ceiling: int | None) -> tuple[int, int] | None:
        """``(version, step)`` of this rank's newest committed part at or below ``ceiling`` that re-reads intact
        against its checksums (a damaged one is skipped with a warning), or ``None``."""
        steps, _, _ = local_state(self.local_dirpath, self.rank, self.world_size, self.keep)
        for step in sorted((s for s in steps if ceiling is None or s <= ceiling), reverse=True):
            problem = part_problem(self.store(steps[step]), step, self.verify)
            if problem is None:
                return steps[step], step
            _log.warning("rank %d: local step %d is damaged: %s", self.rank, step, problem)
        return None

    def store(self, version: int) -> CheckpointStore:
        """This rank's store in local version folder ``version``."""
        return rank_store(version_root(self.local_dirpath, version), self.rank)


def part_problem(store: CheckpointStore, step: int, verify: bool) -> str | None:
    """``None`` when committed generation ``step`` of ``store`` is intact (``verify``: every object re-read against
    its checksum), else what is wrong."""
    try:
        store.manifest(step)
        if not verify:
            return None
        result = store.verify(step)
        return None if result.ok else "; ".join(result.problems) or "failed verification"
    except Exception as exc:  # noqa: BLE001 - this copy is unusable
        return f"{type(exc).__name__}: {exc}"
