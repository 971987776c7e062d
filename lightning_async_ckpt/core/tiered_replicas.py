"""Peer replicas for plain loops: :class:`~lightning_async_ckpt.core.tiered.TieredCheckpointer` with ``replicas=F``.

The same rules as the Lightning callback's (``docs/tiers.md``): the single-writer layout (rank 0 saves, alone), each
committed local generation copied by a :class:`~lightning_async_ckpt.core.replicas.Replicator` to F other ranks'
local tiers over a separate gloo group created here (on every rank, collectively), the targets on other nodes by
the node layout (:func:`~lightning_async_ckpt.core.replicas.replica_plan`), committed by each receiver under the
manifest rules, at most one generation in flight and the newest pending.

:func:`restore_across_ranks` is the restart side for plain loops: every rank agrees on one step, a rank whose local
folder lacks it receives it from a peer (:func:`~lightning_async_ckpt.core.replicas.restore_from_peers`), and the
durable tier is only listed unless it is newer (then every rank reads it, the same step).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.core.replica_persist import manifest_of
from lightning_async_ckpt.core.replicas import Replicator, replica_plan, restore_from_peers
from lightning_async_ckpt.errors import ConfigError, ManifestError
from lightning_async_ckpt.storage.finder import list_steps, newest_intact
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["WRITERS", "Restored", "open_replicas", "require_process_group", "restore_across_ranks", "restore_single"]

_log = logging.getLogger("lightning_async_ckpt")

#: The ranks that save under the single-writer layout of plain loops with replicas.
WRITERS = (0,)


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


def require_process_group() -> None:
    """Raise unless a ``torch.distributed`` process group exists (checked before anything is built).

    Raises:
        ConfigError: Naming ``replicas`` and the fix.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "replicas needs torch.distributed: call torch.distributed.init_process_group on every rank before "
            "TieredCheckpointer(..., replicas=F)"
        )


def open_replicas(
    local_dirpath: str, replicas: int, *, ranks_per_node: int | None, keep_last: int | None
) -> tuple[Any, Replicator]:
    """On every rank (collective): the gloo group of :func:`restore_across_ranks` and this rank's replicator (on a
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
    try:
        targets, sources, every = replica_plan(rank, world, replicas=replicas, ranks_per_node=per_node, writers=WRITERS)
    except ValueError as exc:
        raise ConfigError(f"{exc}: pass replicas=N with N below that (or more nodes)") from exc
    # Two gloo groups, separate from the training group (NCCL on GPUs), created on every rank: one streams the
    # replicas (its receiving threads run from here on), one for restore_across_ranks, whose messages must never
    # reach those threads.
    group = dist.new_group(backend="gloo")
    stream = dist.new_group(backend="gloo")
    replicator = Replicator(stream, local_dirpath, targets=targets, sources=sources, keep_last=keep_last)
    replicator.start_receiving()
    _log.info("replicas of rank %s's local tier go to ranks %s", WRITERS, every)
    return group, replicator


def restore_across_ranks(group: Any, local_dirpath: str, durable: CheckpointStore) -> Restored | None:
    """Collective over ``group``: the generation every rank resumes from, restored into this rank's local folder
    from a peer when it lacks it; ``None`` when no tier holds one (a first run).

    Each rank reports the newest intact generation of its local folder (every object re-read against its checksum;
    a damaged one is skipped with a warning) and the steps listed in ``durable`` (names only). The newest local one
    any rank holds wins unless ``durable`` lists a newer step; then every rank reads ``durable``'s newest verified
    generation, chosen by rank 0.

    Raises:
        ReplicaError: A copy from a peer failed (on every rank).
        StoreUnavailableError: ``durable`` cannot be listed.
    """
    import torch.distributed as dist

    found = newest_intact(local_dirpath, None, accept=lambda _: True, on_skip=_skip)
    newest_local = None if found is None else (found.version, found.info.step)
    listed = max(list_steps(durable).steps, default=None)
    agreed = restore_from_peers(
        group,
        local_dirpath,
        newest_local=newest_local,
        durable_step=listed,
        newest_store=lambda version: _version_store(local_dirpath, version),
        background=True,  # read at once (Restored.open); a received copy is committed in the background
    )
    if agreed is not None:
        store = _version_store(local_dirpath, agreed[0])
        _log.info("every rank resumes from its local tier, step %d (%s)", agreed[1], store.uri)
        return Restored(store, agreed[1], "local", manifest_of(store, agreed[1]))
    choice: list[Any] = [None]
    if dist.get_rank(group) == 0:
        info = durable.latest()
        choice = [None if info is None else info.step]
    dist.broadcast_object_list(choice, src=dist.get_global_rank(group, 0), group=group)
    if choice[0] is None:
        return None
    _log.info("every rank resumes from %s, step %d (no newer local generation on any rank)", durable.uri, choice[0])
    return Restored(durable, choice[0], "durable", durable.manifest(choice[0]))


def restore_single(local_dirpath: str, durable: CheckpointStore) -> Restored | None:
    """One process (no replicas): the newest intact local generation unless ``durable`` lists a newer step (names
    only), else ``durable``'s newest verified one; ``None`` when neither holds one."""
    found = newest_intact(local_dirpath, None, accept=lambda _: True, on_skip=_skip)
    if found is not None and not any(s > found.info.step for s in list_steps(durable).steps):
        return Restored(found.store, found.info.step, "local", found.manifest)
    info = durable.latest()
    if info is None:
        return None
    return Restored(durable, info.step, "durable", durable.manifest(info.step))


def _version_store(local_dirpath: str, version: int) -> CheckpointStore:
    uri = f"{local_dirpath.rstrip('/')}/v{version}" if version else local_dirpath
    return CheckpointStore(uri, check_writable=False)


def _skip(url: str, problems: tuple[str, ...]) -> None:
    message = f"skipping local generation {url}: {'; '.join(problems)}"
    _log.warning("%s", message)
    warnings.warn(message, stacklevel=4)
