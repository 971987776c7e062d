"""Peer replicas for Accelerate's two tiers: ``attach(..., local_dirpath=..., replicas=F)``.

The main process writes the local tier alone; a :class:`~lightning_async_ckpt.tiers.replicas.Replicator` copies each
committed local generation to F other processes on other nodes (accelerate's node layout: one more than the highest
``local_process_index``, or ``ranks_per_node``), over the two gloo groups of
:func:`~lightning_async_ckpt.tiers.tiered_replicas.open_replicas`. With replicas attached,
:func:`~lightning_async_ckpt.accelerate.load_state` restores a process's missing generation from a peer
(:func:`~lightning_async_ckpt.tiers.resume.pick_with_peers`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.accelerate._collective import collective_for
from lightning_async_ckpt.core.collective import agree
from lightning_async_ckpt.tiers.replicas import Replicator, replica_targets
from lightning_async_ckpt.tiers.resume import version_store
from lightning_async_ckpt.tiers.tiered import local_versions
from lightning_async_ckpt.tiers.tiered_replicas import open_replicas

__all__ = [
    "AccelerateReplicas",
    "agree_local_location",
    "open_accelerate_replicas",
    "replica_layout",
]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass
class AccelerateReplicas:
    """The replicas of one attached checkpointer: the restore group and the replicator (its own group).

    Attributes:
        group: The gloo group load_state agrees and copies over (never the replicator's).
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
    fix = "ranks_per_node=1 when each process has a node-local folder of its own"
    replica_targets(0, accelerator.num_processes, replicas=replicas, ranks_per_node=ranks_per_node, fix=fix)
    return ranks_per_node


def open_accelerate_replicas(
    local_dirpath: str, replicas: int, *, ranks_per_node: int, keep_last: int | None
) -> AccelerateReplicas:
    """Collective (every process, in ``attach``): the replicas' groups and this process's replicator, receiving."""
    group, replicator = open_replicas(local_dirpath, replicas, ranks_per_node=ranks_per_node, keep_last=keep_last)
    return AccelerateReplicas(group, replicator, ranks_per_node)


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
        mine = local_versions(local_dirpath, start_step)
    except Exception as exc:  # noqa: BLE001 - raised on every process by agree
        error = exc
    everyone = agree(collective, error, mine, doing="choosing the local tier's version folder")
    version = max(v for v, _ in everyone)
    blocked = {b for _, newer in everyone for b in newer}
    while version in blocked:
        version += 1
    return version_store(local_dirpath, version).uri
