"""Resume of sharded (DCP) generations across two tiers: every rank agrees on one step and one tier.

A local sharded generation is usable only when **every** rank holds its own part intact (:mod:`.local_tier`:
each rank's part is in its own node-local store). :func:`latest_across_tiers` (a collective over the job's group,
like :func:`~lightning_async_ckpt.sharded.once.latest_once`):

1. every rank lists the steps committed in its local stores (every version folder, :func:`local_roots`) for this
   world size and rank, and the lists are all-gathered; rank 0 lists the durable store's newest committed step;
2. from the newest step **every** rank holds locally, down to the durable store's newest: every rank re-reads its
   own part against its checksums and the verdicts are all-gathered; the first step intact on every rank wins
   (a step present on both tiers is read locally);
3. otherwise every rank falls back together to the durable store's newest verified generation (rank 0 verifies,
   :func:`~lightning_async_ckpt.sharded.once.latest_once`), an ordinary reshardable DCP checkpoint.

A rank whose local tier is missing, damaged or behind therefore makes every rank resume from the durable store.

Layout of the local tier: ``<local_dirpath>/rank-<r>`` (version 0), ``<local_dirpath>/v<k>/rank-<r>``: a run that
resumes from a step older than a local generation some rank holds writes a new version folder, since committed
names are never rewritten.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.sharded.once import gloo_group, job_broadcast, latest_once, once
from lightning_async_ckpt.sharded.spread import load_generation
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.local_tier import LOCAL_TIER_KEY, rank_store

__all__ = ["TierChoice", "latest_across_tiers", "local_roots", "local_state", "resolve_across_tiers", "version_root"]

_log = logging.getLogger("lightning_async_ckpt")
_VERSION_RE = re.compile(r"^v([0-9]+)$")


@dataclass(frozen=True)
class TierChoice:
    """The generation every rank resumes from.

    Attributes:
        step: The agreed step.
        tier: ``"local"`` (every rank reads its own local part) or ``"durable"``.
        store: The store this rank loads from (its own local store, or the durable store).
        newest_local: The newest local step any rank holds in the newest version folder (``None``: none).
        version: The newest local version folder any rank has.
    """

    step: int
    tier: str
    store: CheckpointStore
    newest_local: int | None = None
    version: int = 0

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
    import fsspec

    fs, path = fsspec.core.url_to_fs(local_dirpath)
    versions = {0}
    try:
        names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        names = []
    for name in names:
        match = _VERSION_RE.match(name)
        if match:
            versions.add(int(match.group(1)))
    return sorted(versions)


def local_state(local_dirpath: str, rank: int, world_size: int) -> tuple[dict[int, int], int, int | None]:
    """This rank's committed local steps (step -> version), its newest version, that version's newest step."""
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
        for info in listed:
            mark = info.manifest.extra.get(LOCAL_TIER_KEY) if info.manifest is not None else None
            if info.committed and mark == {"rank": rank, "world_size": world_size}:
                steps[info.step] = version
    used = [v for v, listed in per_version.items() if listed]
    top = max(used, default=0)
    return steps, top, max(per_version.get(top, []), default=None)


def latest_across_tiers(local_dirpath: str, durable: CheckpointStore, *, verify: bool = True) -> TierChoice | None:
    """The newest generation every rank can load, from either tier (module docstring); collective.

    Call on every rank together (under ``torch.distributed``; one process works without a group).

    Raises:
        StoreUnavailableError: The durable store cannot be listed (on every rank).
    """
    return resolve_across_tiers(local_dirpath, durable, verify=verify)[0]


def resolve_across_tiers(
    local_dirpath: str, durable: CheckpointStore, *, verify: bool = True
) -> tuple[TierChoice | None, int | None, int]:
    """:func:`latest_across_tiers`, with the newest local step any rank holds in the newest local version folder
    (leftovers included) and that version: a writer resuming below that step writes a new version folder."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    group = None if not distributed or str(dist.get_backend()) == "gloo" else gloo_group()

    def gather(obj: Any) -> list[Any]:
        if not distributed:
            return [obj]
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out

    steps, version, newest = local_state(local_dirpath, rank, world)
    everyone = gather((sorted(steps), version, newest))
    top_version = max(v for _, v, _ in everyone)
    newest_local = max((n for _, v, n in everyone if v == top_version and n is not None), default=None)
    common = set(everyone[0][0]).intersection(*(set(s) for s, _, _ in everyone[1:]))

    def newest_durable() -> int | None:
        listed = [g.step for g in durable.generations() if g.committed]
        return max(listed) if listed else None

    floor = once(newest_durable, broadcast=job_broadcast(), doing=f"listing {durable.uri}")
    for step in sorted(common, reverse=True):
        if floor is not None and step < floor:
            break
        store = rank_store(version_root(local_dirpath, steps[step]), rank)
        problem = None
        if verify:
            try:
                result = store.verify(step)
                problem = None if result.ok else "; ".join(result.problems) or "failed verification"
            except Exception as exc:  # noqa: BLE001 - gathered: this rank's part is unusable
                problem = f"{type(exc).__name__}: {exc}"
        verdicts = gather(problem)
        bad = {r: p for r, p in enumerate(verdicts) if p is not None}
        if not bad:
            _log.info("resuming step %d from the local tier %s (every rank holds it intact)", step, local_dirpath)
            return TierChoice(step, "local", store, newest_local, top_version), newest_local, top_version
        _log.warning("local step %d is damaged on rank(s) %s: %s", step, sorted(bad), bad)
    info = latest_once(durable, verify=verify)
    if info is None:
        if newest_local is not None:
            _log.warning("no generation every rank holds intact on either tier: starting fresh")
        return None, newest_local, top_version
    _log.info("resuming step %d from the durable tier %s", info.step, durable.uri)
    return TierChoice(info.step, "durable", durable, newest_local, top_version), newest_local, top_version
