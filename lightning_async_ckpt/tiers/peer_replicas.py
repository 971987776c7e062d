"""Peer replicas of sharded (DCP) local tiers: every rank's committed ``rank-<r>`` generation copied to F other ranks.

:class:`DcpReplicas` creates two gloo groups once, on every rank: one streams replicas (a
:class:`~lightning_async_ckpt.tiers.replicas.Replicator` per rank, into the targets'
``<local_dirpath>[/v<k>]/replica-of-rank-<r>``), one serves :meth:`DcpReplicas.resume`: the steps every rank can get
(its own part, or a peer's intact replica of it, copied into its own store first) and not older than the durable
tier's newest committed step are tried newest first; only when none works does every rank fall back to the durable
tier together.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import fsspec
import torch.distributed as dist

from lightning_async_ckpt.core.collective import TorchCollective, agree
from lightning_async_ckpt.errors import ConfigError, StoreUnavailableError
from lightning_async_ckpt.storage.finder import newest_committed_above
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import gather
from lightning_async_ckpt.tiers.local_tier import rank_store
from lightning_async_ckpt.tiers.replica_wire import Wire, receive_from, send_generation
from lightning_async_ckpt.tiers.replicas import open_replicator, replica_targets
from lightning_async_ckpt.tiers.resume import durable_roots
from lightning_async_ckpt.tiers.sharded_resume import (
    TierChoice,
    agreed_lineage,
    from_durable,
    local_roots,
    local_state,
    part_problem,
    parts_of,
    version_root,
)
from lightning_async_ckpt.tiers.target import check_tier_options
from lightning_async_ckpt.tiers.tiered_replicas import require_process_group

__all__ = [
    "REPLICA_PREFIX",
    "DcpReplicas",
    "check_replicas",
    "held_replicas",
    "local_from_peers",
    "replica_store",
    "replica_where",
]

_log = logging.getLogger("lightning_async_ckpt")

#: A replica of rank ``r``'s local generations lives in ``<local_dirpath>[/v<k>]/replica-of-rank-<r>``.
REPLICA_PREFIX = "replica-of-"
_REPLICA_RE = re.compile(r"^replica-of-rank-([0-9]+)$")


def replica_store(local_dirpath: str, version: int, source: int) -> CheckpointStore:
    """The store holding this folder's replicas of rank ``source``'s generations of local version ``version``."""
    return CheckpointStore(
        f"{version_root(local_dirpath, version)}/{REPLICA_PREFIX}rank-{source}", check_writable=False
    )


def replica_where(local_dirpath: str, uri: str) -> str:
    """Where, relative to a target's local tier, the replica of local store ``uri`` goes: ``[v<k>/]rank-<r>`` ->
    ``[v<k>/]replica-of-rank-<r>``."""
    root, uri = local_dirpath.rstrip("/"), uri.rstrip("/")
    relative = uri[len(root) + 1 :] if uri.startswith(root + "/") else uri.rsplit("/", 1)[-1]
    head, _, name = relative.rpartition("/")
    return f"{head}/{REPLICA_PREFIX}{name}" if head else f"{REPLICA_PREFIX}{name}"


def held_replicas(
    local_dirpath: str, world_size: int, keep: Callable[[Manifest], bool] | None = None
) -> dict[int, dict[int, int]]:
    """The committed replicas this folder holds: source rank -> {step: version} (generations of this world size;
    with ``keep``, only those whose manifest it keeps)."""
    out: dict[int, dict[int, int]] = {}
    fs, _ = fsspec.core.url_to_fs(local_dirpath)
    for version in local_roots(local_dirpath):
        root = fsspec.core.url_to_fs(version_root(local_dirpath, version))[1]
        try:
            names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        except FileNotFoundError:
            continue
        for name in names:
            match = _REPLICA_RE.match(name)
            if match is None:
                continue
            source = int(match.group(1))
            try:
                listed = replica_store(local_dirpath, version, source).generations()
            except Exception as exc:  # noqa: BLE001 - an unreadable replica folder is a missing one
                _log.warning("replicas of rank %d in %s cannot be listed (%s): not used", source, root, exc)
                continue
            for step in parts_of(listed, source, world_size, keep):
                out.setdefault(source, {})[step] = version
    return out


def check_replicas(replicas: int | None, ranks_per_node: int | None, local_dirpath: str = "") -> dict[int, list[int]]:
    """Raise unless ``replicas`` / ``ranks_per_node`` are usable (before anything is built); every rank's targets
    (empty without ``replicas``).

    Raises:
        ConfigError: Naming the parameter and the fix.
    """
    check_tier_options(replicas=replicas, ranks_per_node=ranks_per_node)
    if replicas is None:
        return {}
    if "://" in local_dirpath and not local_dirpath.startswith("file://"):
        raise ConfigError(f"replicas needs a node-local folder as local_dirpath, got {local_dirpath!r}")
    require_process_group("TieredShardedCheckpointer")
    world = dist.get_world_size()
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    fix = "more nodes, ranks_per_node=..."
    return {r: replica_targets(r, world, replicas=replicas, ranks_per_node=per_node, fix=fix) for r in range(world)}


class DcpReplicas:
    """Peer replicas of one rank's sharded local tier (module docstring). Construct on every rank (collective).

    Args:
        local_dirpath: This rank's local tier.
        replicas: How many other ranks hold a replica of each of this rank's generations.
        ranks_per_node: Ranks per node (``None``: ``LOCAL_WORLD_SIZE``, else every rank on one node).
        keep_last: Retention of each replica folder (``None``: keep all).
        timeout_s: Timeout of the two gloo groups.
        on_event: An ``EventLog.emit`` (``replicated`` / ``replica_failed``).

    Raises:
        ConfigError: No process group, ``local_dirpath`` not a local folder, or ``replicas`` too large.
    """

    def __init__(
        self,
        local_dirpath: str,
        replicas: int,
        *,
        ranks_per_node: int | None,
        keep_last: int | None,
        timeout_s: float,
        on_event: Any = None,
    ) -> None:
        plan = check_replicas(replicas, ranks_per_node, local_dirpath)
        self.local_dirpath = local_dirpath.rstrip("/")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group, self.replicator = open_replicator(
            self.local_dirpath,
            timeout_s=timeout_s,
            targets=plan[self.rank],
            sources=[r for r, targets in plan.items() if self.rank in targets],
            keep_last=keep_last,
            on_event=on_event,
            where=lambda uri: replica_where(self.local_dirpath, uri),
        )
        _log.info("replicas of rank %d's local generations go to ranks %s", self.rank, plan[self.rank])

    def replicate(self, store: CheckpointStore, step: int) -> None:
        """Send committed generation ``step`` of this rank's local ``store`` to the targets, in the background."""
        self.replicator.replicate(store, step)

    def resume(self, durable: CheckpointStore, *, verify: bool = True) -> TierChoice | None:
        """The generation every rank resumes from: :func:`local_from_peers`, else the durable tier's newest verified
        one on every rank (rank 0 finds it); ``None`` when neither holds one. Collective.

        Raises:
            StoreUnavailableError: The durable tier cannot be listed (on every rank).
        """
        choice = local_from_peers(self.group, self.local_dirpath, durable, verify=verify)
        return choice if choice is not None else from_durable(durable, verify=verify)


def local_from_peers(
    group: Any, local_dirpath: str, durable: CheckpointStore, *, verify: bool = True
) -> TierChoice | None:
    """The newest local step every rank can get, its own part or a peer's intact replica of it (copied into its own
    store first), and not older than a step committed on ``durable`` above rank 0's newest own one; ``None`` when none:
    every rank then resumes from ``durable`` together. Collective over ``group`` (a gloo group of every rank).

    Raises:
        StoreUnavailableError: ``durable`` cannot be listed (on every rank).
    """
    return _PeerResume(group, local_dirpath.rstrip("/")).choose(durable, verify)


class _PeerResume:
    """One collective resume of :func:`local_from_peers`."""

    def __init__(self, group: Any, local_dirpath: str) -> None:
        self.group, self.local_dirpath = group, local_dirpath
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def choose(self, durable: CheckpointStore, verify: bool) -> TierChoice | None:
        """:func:`local_from_peers`: gather every rank's own steps and held replicas, try the candidates newest first."""
        local, rank = self.local_dirpath, self.rank
        # Only this run's lineage, the same on every rank (a refusal or a failed listing raised on every rank).
        collective = TorchCollective(self.group)
        keep = agreed_lineage(local, durable, collective, "resuming from peers")
        own: dict[int, int] = {}
        held: dict[int, dict[int, int]] = {}
        error: Exception | None = None
        try:
            own, _, _ = local_state(local, rank, self.world_size, keep)
            held = held_replicas(local, self.world_size, keep)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree (the others would wait)
            error = exc
        listed: Any = None
        if rank == 0 and error is None:
            try:
                listed = newest_committed_above(durable_roots(durable), max(own, default=None))
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                listed = f"{type(exc).__name__}: {exc}"
        payload = {"own": own, "held": held, "durable": listed}
        everyone = agree(collective, error, payload, doing="resuming from peers: the local tiers")
        durable_step = everyone[0]["durable"]
        if isinstance(durable_step, str):
            raise StoreUnavailableError(f"rank 0 could not list the durable tier {durable.uri}: {durable_step}")
        world = range(self.world_size)

        def sources(r: int, step: int) -> list[int]:
            return [t for t in world if t != r and step in everyone[t]["held"].get(r, {})]

        steps = {s for e in everyone for s in e["own"]} | {s for e in everyone for h in e["held"].values() for s in h}
        candidates = sorted(
            (s for s in steps if all(s in everyone[r]["own"] or sources(r, s) for r in world)), reverse=True
        )
        for step in candidates:
            if durable_step is not None and step < durable_step:
                break
            version = self._restore(step, everyone, sources, verify)
            if version is not None:
                store = rank_store(version_root(local, version), rank)
                return TierChoice(step, "local", store)
        return None

    def _restore(self, step: int, everyone: list[Any], sources: Any, verify: bool) -> int | None:
        """Make ``step`` whole on every rank; this rank's version folder holding it, or ``None`` (no peer has an
        intact copy of some rank's part, or a copy failed) on every rank."""
        local, rank = self.local_dirpath, self.rank
        own = everyone[rank]["own"]
        problem = (
            "missing"
            if step not in own
            else part_problem(rank_store(version_root(local, own[step]), rank), step, verify)
        )
        verdicts = gather(self.group, problem)
        needers = [r for r, p in enumerate(verdicts) if p is not None]
        if not needers:
            _log.info("resuming step %d from the local tier %s (every rank holds it intact)", step, local)
            return own[step]
        held = everyone[rank]["held"]
        checks = {
            r: part_problem(replica_store(local, held[r][step], r), step, True)
            for r in needers
            if r != rank and step in held.get(r, {})
        }
        found = gather(self.group, checks)
        pairs: list[tuple[int, int, int]] = []  # (needer, source, version of the source's replica)
        for r in needers:
            intact = [t for t in sources(r, step) if r in found[t] and found[t][r] is None]
            if not intact:
                _log.warning(
                    "local step %d: rank %d's part is %s and no peer holds an intact replica", step, r, verdicts[r]
                )
                return None
            pairs.append((r, intact[0], everyone[intact[0]]["held"][r][step]))
        here, failure = own.get(step), None
        wire = Wire(self.group)
        for needer, source, version in pairs:
            try:
                if rank == source:
                    send_generation(wire, replica_store(local, version, needer), step, "", needer)
                elif rank == needer:
                    here = version if step not in own else max(local_roots(local)) + 1
                    receive_from(wire, source, local, f"v{here}/rank-{rank}" if here else f"rank-{rank}", step)
                    _log.warning(
                        "rank %d's local part of step %d was %s: restored from rank %d's replica",
                        rank,
                        step,
                        verdicts[rank],
                        source,
                    )
            except Exception as exc:  # noqa: BLE001 - agreed on below
                failure = f"{type(exc).__name__}: {exc}"
        outcome = gather(self.group, failure)
        if any(outcome):
            _log.warning("restoring local step %d from peers failed: %s", step, [o for o in outcome if o])
            return None
        return here
