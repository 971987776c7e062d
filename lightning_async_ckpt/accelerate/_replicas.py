"""Peer replicas for Accelerate's two tiers: ``attach(..., local_dirpath=..., replicas=F)``.

Only the main process writes the local tier (the single-writer layout of plain loops and Lightning DDP), so its
committed local generations are what gets copied: a
:class:`~lightning_async_ckpt.tiers.replicas.Replicator` sends each one, in the background (thread
``lightning_async_ckpt-replicate``), to F other processes on other nodes. The node layout is accelerate's: the
number of processes per node is one more than the highest ``accelerator.local_process_index`` (or
``ranks_per_node``), and replica ``i`` goes to process ``i * ranks_per_node`` when there are several nodes
(:func:`~lightning_async_ckpt.tiers.replicas.replica_plan`). The groups are
:func:`~lightning_async_ckpt.tiers.tiered_replicas.open_replicas`'s: two gloo groups created once, at ``attach``, on
every process, never the training's group; each receiver writes its own folder, objects checked against the source
manifest, the manifest last (a half-copied replica is never listed as committed).

:func:`choose_with_peers` is :func:`~lightning_async_ckpt.accelerate.load_state`'s choice with replicas attached:
every process reports the newest intact generation of its ``local_dirpath`` (every object re-read against its
checksum, so a damaged replica is never used), the main process lists ``uri`` (names only), the processes agree on
the newest local one any process holds unless ``uri`` lists a newer step, and a process whose folder lacks it
receives it from one that holds it (:func:`~lightning_async_ckpt.tiers.replicas.restore_from_peers`). Only when no
process holds a generation as new as ``uri``'s does every process load from ``uri`` together.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.accelerate._choose import Choice
from lightning_async_ckpt.accelerate._collective import collective_for
from lightning_async_ckpt.accelerate._tier_load import accept_accelerate, holding_version, skip_damaged, version_store
from lightning_async_ckpt.core.collective import agree
from lightning_async_ckpt.errors import CheckpointError, ConfigError
from lightning_async_ckpt.storage.finder import durable_step_to_beat
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.lookup import newest_intact
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.replica_persist import manifest_of
from lightning_async_ckpt.tiers.replicas import Replicator, replica_targets, restore_from_peers
from lightning_async_ckpt.tiers.tiered_replicas import open_replicas

__all__ = [
    "AccelerateReplicas",
    "agree_local_location",
    "choose_with_peers",
    "open_accelerate_replicas",
    "replica_layout",
]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass
class AccelerateReplicas:
    """The replicas of one attached checkpointer: the restore group and the replicator (its own group).

    Attributes:
        group: The gloo group :func:`choose_with_peers` agrees and copies over (never the replicator's).
        replicator: Sends the main process's committed local generations; receives on the targets.
        ranks_per_node: The node layout the targets were chosen by.
    """

    group: Any
    replicator: Replicator
    ranks_per_node: int

    def close(self, timeout: float | None) -> bool:
        """Finish the replications asked for, stop the receivers, and destroy both groups; whether in time."""
        import torch.distributed as dist

        try:
            return self.replicator.close(timeout)
        finally:
            for group in (self.group, self.replicator.wire.group):
                if group is not None and dist.is_initialized():
                    with contextlib.suppress(Exception):  # best effort: a peer may already be gone
                        dist.destroy_process_group(group)
            self.group = None


def replica_layout(accelerator: Any, replicas: int, ranks_per_node: int | None) -> int | None:
    """Collective (every process, in ``attach``, before anything is built): the processes per node the replicas'
    targets are chosen by, checked against ``replicas``; ``None`` (with a warning) for a single process.

    Raises:
        ConfigError: ``replicas`` is more than the other nodes (or, on one node, the other processes) can hold.
    """
    if accelerator.num_processes < 2:
        _log.warning("replicas=%d: a single process has no peer; no replicas are made", replicas)
        return None
    if ranks_per_node is None:
        # accelerate's node layout: every process's index on its node (LOCAL_RANK), gathered (training thread).
        indices = agree(collective_for(accelerator), None, accelerator.local_process_index, doing="the node layout")
        ranks_per_node = 1 + max(indices)
    try:
        replica_targets(0, accelerator.num_processes, replicas=replicas, ranks_per_node=ranks_per_node)
    except ValueError as exc:
        raise ConfigError(
            f"{exc}: pass replicas=N with N below that (or ranks_per_node=1 when each process has a "
            "node-local folder of its own)"
        ) from exc
    return ranks_per_node


def open_accelerate_replicas(
    local_dirpath: str, replicas: int, *, ranks_per_node: int, keep_last: int | None
) -> AccelerateReplicas:
    """Collective (every process, in ``attach``): the replicas' groups and this process's replicator, receiving."""
    group, replicator = open_replicas(local_dirpath, replicas, ranks_per_node=ranks_per_node, keep_last=keep_last)
    return AccelerateReplicas(group, replicator, ranks_per_node)


def choose_with_peers(
    accelerator: Any,
    collective: Any,
    replicas: AccelerateReplicas,
    uri: str,
    local_dirpath: str,
    options: dict[str, Any],
    step: int | None,
) -> Choice | None:
    """Collective: the local generation every process loads, restored into this process's ``local_dirpath`` from a
    peer where it lacks it; ``None`` when every process loads from ``uri`` (it lists a newer step, or no process
    holds a local generation; with ``step``: no process holds ``step`` intact locally).

    Raises:
        RankFailedError: Another process failed to look at its folder or ``uri`` (its error is raised there).
        StoreUnavailableError: ``uri`` cannot be listed (main process).
        ReplicaError: A copy from a peer failed (on every process).
    """
    if replicas.group is None:
        raise CheckpointError("the replicas of this checkpointer were closed; attach() a new one")
    error: BaseException | None = None
    newest: tuple[int, int] | None = None
    durable: int | None = None
    try:
        newest = _newest(local_dirpath) if step is None else _holding(local_dirpath, step)
        if accelerator.is_main_process and step is None:
            stores = [CheckpointStore(uri, options, check_writable=False).location]
            durable = durable_step_to_beat(stores, None if newest is None else newest[1])
    except Exception as exc:  # noqa: BLE001 - raised on every process by agree
        error = exc
    # Errors first, on the bounded exchange: restore_from_peers' group would wait for a failed process forever.
    agree(collective, error, doing="load_state: finding the local tiers' newest step")
    agreed = restore_from_peers(
        replicas.group,
        local_dirpath,
        newest_local=newest,
        durable_step=durable,
        newest_store=lambda version: version_store(local_dirpath, version),
        background=True,  # loaded at once: a received copy's fsync and commit go on in the background
    )
    if agreed is None:
        _log.info("load_state: no process holds a local generation as new as %s's: loading from it", uri)
        return None
    store = version_store(local_dirpath, agreed[0])
    _log.info("load_state: every process resumes from its local tier, step %d (%s)", agreed[1], store.uri)
    return Choice(url=store.url(agreed[1]), step=agreed[1], manifest=manifest_of(store, agreed[1]))


def agree_local_location(collective: Any, local_dirpath: str, start_step: int) -> str:
    """Collective: the local tier location the main process writes from ``start_step`` on, chosen so that every
    process's folder holds no generation newer than ``start_step`` (committed or not) in that version folder.

    Replicas land in the version folder of their source. Were the main process to choose alone
    (:func:`~lightning_async_ckpt.tiers.tiered.local_location`), a peer still holding a newer (damaged, or branched
    off) generation of the same step there would answer a replica with "another step" and fail the save, or keep
    its damaged copy. The version is the highest one any process would choose alone, raised past every version folder
    that some process holds newer steps in.

    Raises:
        RankFailedError: Another process could not list its folder (its error is raised there).
    """
    error: BaseException | None = None
    mine: tuple[int, list[int]] = (0, [])
    try:
        mine = _own_location(local_dirpath, start_step)
    except Exception as exc:  # noqa: BLE001 - raised on every process by agree
        error = exc
    everyone = agree(collective, error, mine, doing="choosing the local tier's version folder")
    version = max(v for v, _ in everyone)
    blocked = {b for _, newer in everyone for b in newer}
    while version in blocked:
        version += 1
    return version_store(local_dirpath, version).uri


def _own_location(local_dirpath: str, start_step: int) -> tuple[int, list[int]]:
    """The version :func:`~lightning_async_ckpt.tiers.tiered.local_location` picks here, and the version folders
    holding a generation newer than ``start_step``."""
    root = CheckpointStore(local_dirpath, check_writable=False)
    versions = [0, *version_folders(root.fs, root.root)]
    newer = []
    for version in versions:
        store = version_store(local_dirpath, version)
        steps = [g.step for g in store.scan(include_uncommitted=True).generations if g.holds_step]
        if steps and max(steps) > start_step:
            newer.append(version)
    free = [v for v in versions if v not in newer]
    return (max(free) if free else max(versions) + 1), newer


def _newest(local_dirpath: str) -> tuple[int, int] | None:
    found = newest_intact(local_dirpath, None, accept=accept_accelerate, on_skip=skip_damaged)
    return None if found is None else (found.version, found.info.step)


def _holding(local_dirpath: str, step: int) -> tuple[int, int] | None:
    version = holding_version(local_dirpath, step)
    return None if version is None else (version, step)
