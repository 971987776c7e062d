"""Peer replicas for plain loops: :class:`~lightning_async_ckpt.tiers.tiered.TieredCheckpointer` with ``replicas=F``.

The Lightning callback's rules (``docs/tiers.md``): rank 0 saves alone, a
:class:`~lightning_async_ckpt.tiers.replicas.Replicator` copies each committed local generation to F other ranks
(other nodes first). :func:`restore_tiered` is the restart side (:mod:`~lightning_async_ckpt.tiers.resume`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.errors import ConfigError, ManifestError
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import from_first
from lightning_async_ckpt.tiers.replica_persist import manifest_of
from lightning_async_ckpt.tiers.replicas import WRITERS, Replicator, open_replicator, replica_plan
from lightning_async_ckpt.tiers.resume import OneStream, keeps_local, pick_local, pick_with_peers

__all__ = [
    "WRITERS",
    "Restored",
    "open_replicas",
    "require_process_group",
    "restore_tiered",
]

_log = logging.getLogger("lightning_async_ckpt")


@dataclass(frozen=True)
class Restored:
    """The generation every rank resumes from.

    Attributes:
        store: Where this rank reads it: its local tier (a version folder of it) or the durable store.
        step: The agreed step (the same on every rank).
        tier: ``"local"`` or ``"durable"``.
        manifest: Its manifest (read from ``store``).
    """

    store: CheckpointStore
    step: int
    tier: str
    manifest: Manifest

    def open(self, name: str = "checkpoint.ckpt") -> Any:
        """Open object ``name`` of the generation for reading (the default serializer's object by default).

        Raises:
            ManifestError: The manifest lists no object ``name``.
        """
        try:
            entry = self.manifest.object(name)
        except KeyError as exc:
            raise ManifestError(str(exc.args[0])) from exc
        # Through the manifest held here: one restored from a peer is still being committed in the background.
        return self.store.fs.open(f"{self.store.generation_path(self.step)}/{entry.key}", "rb")


def require_process_group(who: str = "TieredCheckpointer") -> None:
    """Raise unless a ``torch.distributed`` process group exists (checked before anything is built by ``who``).

    Raises:
        ConfigError: Naming ``replicas`` and the fix.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "replicas needs torch.distributed: call torch.distributed.init_process_group on every rank before "
            f"{who}(..., replicas=F)"
        )


def open_replicas(
    local_dirpath: str, replicas: int, *, ranks_per_node: int | None, keep_last: int | None
) -> tuple[Any, Replicator]:
    """On every rank (collective): the gloo group of :func:`restore_tiered` and this rank's replicator (on a
    second gloo group), receiving already.

    Raises:
        ConfigError: No ``torch.distributed`` process group, ``replicas`` too large for the layout, or
            ``local_dirpath`` not a local folder.
    """
    import torch.distributed as dist

    require_process_group()
    if "://" in local_dirpath and not local_dirpath.startswith("file://"):
        raise ConfigError(f"replicas needs a node-local folder as the local tier, got {local_dirpath!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    targets, sources, every = replica_plan(rank, world, replicas=replicas, ranks_per_node=per_node, writers=WRITERS)
    group, replicator = open_replicator(local_dirpath, targets=targets, sources=sources, keep_last=keep_last)
    _log.info("replicas of rank %s's local tier go to ranks %s", WRITERS, every)
    return group, replicator


def restore_tiered(group: Any, local_dirpath: str, durable: CheckpointStore) -> Restored | None:
    """The generation this run resumes from (:mod:`~lightning_async_ckpt.tiers.resume`): the newest intact local
    one of this run lineage unless ``durable`` holds a newer committed step, else ``durable``'s newest verified one
    (unless that is older: the newer one was damaged); ``None`` when neither holds one.

    With the replicas' ``group`` it is collective: every rank agrees on one step, a rank whose local folder lacks it
    receives it from a peer, and rank 0 chooses ``durable``'s generation for every rank.

    Raises:
        ConfigError: ``local_dirpath`` holds generations of several runs and ``durable`` says none is this one's.
        ReplicaError: A copy from a peer failed (on every rank).
        StoreUnavailableError: ``durable`` cannot be listed.
    """
    tier = OneStream(local_dirpath, durable)
    local = pick_local(tier, durable) if group is None else pick_with_peers(group, tier, durable)
    step = None if local is not None and local.beaten_by is None else _durable_latest(group, durable)
    if keeps_local(local, step):
        assert local is not None
        _log.info("resuming from the local tier, step %d (%s)", local.step, local.store.uri)
        return Restored(local.store, local.step, "local", manifest_of(local.store, local.step))
    if step is None:
        return None
    _log.info("resuming from %s, step %d (no newer local generation)", durable.uri, step)
    return Restored(durable, step, "durable", durable.manifest(step))


def _durable_latest(group: Any, durable: CheckpointStore) -> int | None:
    """``durable``'s newest verified step, chosen by rank 0 of ``group`` for every rank (alone without one)."""
    import torch.distributed as dist

    info = durable.latest() if group is None or dist.get_rank(group) == 0 else None
    return from_first(group, None if info is None else info.step)
