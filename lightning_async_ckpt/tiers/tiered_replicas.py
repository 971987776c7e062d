"""Peer replicas for plain loops: :class:`~lightning_async_ckpt.tiers.tiered.TieredCheckpointer` with ``replicas=F``.

The same rules as the Lightning callback's (``docs/tiers.md``): the single-writer layout (rank 0 saves, alone), each
committed local generation copied by a :class:`~lightning_async_ckpt.tiers.replicas.Replicator` to F other ranks'
local tiers over a separate gloo group created here (on every rank, collectively), the targets on other nodes by
the node layout (:func:`~lightning_async_ckpt.tiers.replicas.replica_plan`), committed by each receiver under the
manifest rules, at most one generation in flight and the newest pending.

:func:`restore_across_ranks` is the restart side for plain loops: every rank agrees on one step, a rank whose local
folder lacks it receives it from a peer (:func:`~lightning_async_ckpt.tiers.replicas.restore_from_peers`), and the
durable tier is only listed unless it is newer (then every rank reads it, the same step).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.errors import ConfigError, ManifestError
from lightning_async_ckpt.storage.finder import list_steps, newest_committed_above
from lightning_async_ckpt.storage.lookup import newest_intact
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY
from lightning_async_ckpt.tiers.replica_persist import manifest_of
from lightning_async_ckpt.tiers.replicas import Replicator, replica_plan, restore_from_peers

__all__ = [
    "WRITERS",
    "Restored",
    "open_replicas",
    "require_process_group",
    "restore_across_ranks",
    "restore_single",
    "this_lineage",
]

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

    found = newest_intact(local_dirpath, None, accept=this_lineage(local_dirpath, durable), on_skip=_skip)
    newest_local = None if found is None else (found.version, found.info.step)
    # A rank holding no local generation has nothing to compare: the ranks holding one say whether durable is newer.
    newer = None if found is None else newest_committed_above([durable.location], found.info.step)
    agreed = restore_from_peers(
        group,
        local_dirpath,
        newest_local=newest_local,
        durable_step=newer,
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
    """One process (no replicas): the newest committed generation of this run across both tiers (the local one
    when intact and no newer step is committed on ``durable``, else ``durable``'s newest verified one, unless that
    is older); ``None`` when neither holds one.

    Raises:
        ConfigError: ``local_dirpath`` holds generations of several runs and ``durable`` says none is this one's.
    """
    found = newest_intact(local_dirpath, None, accept=this_lineage(local_dirpath, durable), on_skip=_skip)
    if found is not None and newest_committed_above([durable.location], found.info.step) is None:
        return Restored(found.store, found.info.step, "local", found.manifest)
    info = durable.latest()
    if info is None or (found is not None and info.step <= found.info.step):  # the newer one was damaged
        return None if found is None else Restored(found.store, found.info.step, "local", found.manifest)
    return Restored(durable, info.step, "durable", durable.manifest(info.step))


def this_lineage(local_dirpath: str, durable: CheckpointStore) -> Callable[[Manifest], bool]:
    """Which committed local generations belong to the run that resumes: all of them while the local tier holds one
    run's generations; when it holds several runs' (a shared ``local_dirpath``), the run of ``durable``'s newest
    generation (the run it was promoted from), so one run never resumes another's generation.

    Raises:
        ConfigError: Several runs' generations and ``durable`` names none of them: this run cannot tell its own.
    """
    runs = {
        g.manifest.run_id
        for store in _version_stores(local_dirpath)
        for g in store.scan(include_uncommitted=False).generations
        if g.committed and g.manifest is not None
    }
    if len(runs) <= 1:
        return lambda _: True
    info = durable.latest(verify=False)
    ours = set() if info is None or info.manifest is None else {info.manifest.run_id}
    if info is not None and info.manifest is not None:
        ours.add(str(info.manifest.extra.get(PROMOTED_FROM_KEY, {}).get("run_id", "")))
    if not ours & runs:
        raise ConfigError(
            f"local_dirpath {local_dirpath!r} holds generations of {len(runs)} runs ({', '.join(sorted(runs))}) and "
            f"the durable tier {durable.uri!r} names none of them, so this run cannot tell its own: give each run its "
            "own local_dirpath (e.g. one folder per run name), or remove the other runs' generations"
        )
    return lambda manifest: manifest.run_id in ours


def _version_stores(local_dirpath: str) -> list[CheckpointStore]:
    root = CheckpointStore(local_dirpath, check_writable=False)
    return [root, *(_version_store(local_dirpath, v) for v in list_steps(root.location).versions)]


def _version_store(local_dirpath: str, version: int) -> CheckpointStore:
    uri = f"{local_dirpath.rstrip('/')}/v{version}" if version else local_dirpath
    return CheckpointStore(uri, check_writable=False)


def _skip(url: str, problems: tuple[str, ...]) -> None:
    message = f"skipping local generation {url}: {'; '.join(problems)}"
    _log.warning("%s", message)
    warnings.warn(message, stacklevel=4)
