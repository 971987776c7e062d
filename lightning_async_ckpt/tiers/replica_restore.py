"""The restart side of peer replicas: :func:`restore_from_peers`, collective over the replicas' group.

Every rank reports the newest intact generation of its local tier; the ranks agree on the newest step any rank holds
(unless the durable tier is newer), and each folder that lacks it receives it from a rank that holds it. Version
folders are a folder's own (a repaired replica, :mod:`~lightning_async_ckpt.tiers.replica_repair`, lives in a newer
one than its source's): ranks agree on the step, and each rank answers the version folder that holds it in its own
folder.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.background import gather
from lightning_async_ckpt.tiers.replica_wire import ReplicaError, Wire, receive_from, send_generation

__all__ = ["folder_id", "restore_from_peers"]

_log = logging.getLogger("lightning_async_ckpt")
_ID_FILE = ".tier-id"


def folder_id(root: str) -> str:
    """A random id stored in local folder ``root`` (created once, exclusively): ranks that share a folder see one id."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, _ID_FILE)
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(uuid.uuid4().hex)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # exclusive and atomic: the first rank's id wins, never a half-written one
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()


def restore_from_peers(
    group: Any,
    local_dirpath: str,
    *,
    newest_local: tuple[int, int] | None,
    durable_step: int | None,
    newest_store: Callable[[int], CheckpointStore],
    background: bool = False,
) -> tuple[int, int] | None:
    """Collective over ``group`` (every rank calls it): agree on the generation every rank resumes from, and copy
    it into each local folder that lacks it from a rank that holds it.

    Args:
        group: The replicas' gloo group (every rank).
        local_dirpath: This rank's local tier.
        newest_local: ``(version, step)`` of the newest intact generation of this rank's local tier, or ``None``.
        durable_step: The newest step this rank sees listed in the durable tier, or ``None``.
        newest_store: The local store of a version folder (``0``: ``local_dirpath`` itself).
        background: A received generation is answered once its bytes are checked and in the page cache; its
            ``fsync`` and commit follow on a thread (:mod:`~lightning_async_ckpt.tiers.replica_persist`): read its
            manifest with ``replica_persist.manifest_of`` until then. For a restart that loads it at once.

    Returns:
        ``(version, step)`` of the agreed local generation, now committed in this rank's folder (with
        ``background``: being committed), or ``None`` when
        every rank resumes from the durable tier (it is newer, or no rank holds a local generation). Ranks agree on
        the step; the version is this folder's own: a folder holding a damaged copy of the agreed generation
        (committed, so never overwritten) receives it into a new version folder.

    Raises:
        ReplicaError: A copy failed (on the ranks that sent or received it; the others see the barrier fail).
    """
    rank = dist.get_rank(group)
    mine = {"local": newest_local, "durable": durable_step, "folder": folder_id(local_dirpath)}
    everyone = gather(group, mine)
    held = [e["local"][1] for e in everyone if e["local"] is not None]
    durable = max((e["durable"] for e in everyone if e["durable"] is not None), default=None)
    if not held:
        return None
    step = max(held)
    if durable is not None and durable > step:
        return None
    # Ranks agree on the step; a version folder is each folder's own (a repaired replica lives in a newer one).
    holders = [r for r, e in enumerate(everyone) if e["local"] is not None and e["local"][1] == step]
    version = max(everyone[r]["local"][0] for r in holders)  # where a folder lacking the step receives it
    have = {everyone[r]["folder"] for r in holders}
    needers: list[int] = []
    for r, e in enumerate(everyone):
        if e["folder"] not in have:
            have.add(e["folder"])  # one receiving rank per folder; the ranks sharing it see its copy
            needers.append(r)
    wire, failure = Wire(group), None
    here = newest_local[0] if newest_local is not None and newest_local[1] == step else version
    for i, needer in enumerate(needers):
        source = holders[i % len(holders)]
        try:
            if rank == source:
                own = everyone[source]["local"][0]
                send_generation(wire, newest_store(own), step, _version_name(own), needer)
                _log.info("restored step %d to rank %d's local tier from this rank", step, needer)
            elif rank == needer:
                here = _free_version(local_dirpath, newest_store(version), (version, step))
                receive_from(wire, source, local_dirpath, _version_name(here), step, background=background)
                _log.warning("local tier lost step %d: restored from rank %d's replica", step, source)
        except Exception as exc:  # noqa: BLE001 - agreed below
            failure = exc
    problem = None if failure is None else f"{type(failure).__name__}: {failure}"
    outcome = gather(group, (problem, here))
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(outcome) if p]
    if problems:
        raise ReplicaError("restoring the local tier from peers failed: " + "; ".join(problems))
    # The ranks sharing a needer's folder take the version it received into.
    mine_folder = everyone[rank]["folder"]
    receiver = next((n for n in needers if everyone[n]["folder"] == mine_folder), None)
    return (outcome[receiver][1] if receiver is not None else here), step


def _free_version(local_dirpath: str, store: CheckpointStore, agreed: tuple[int, int]) -> int:
    """Where this folder receives the agreed generation: its own version, unless that holds a committed copy of it
    (damaged, or this rank would hold it intact): then a new version folder (committed names are never overwritten)."""
    try:
        store.manifest(agreed[1])
    except Exception:  # noqa: BLE001 - not committed there (missing, leftover, rejected): receive it there
        return agreed[0]
    root = CheckpointStore(local_dirpath, check_writable=False)
    return max([agreed[0], *version_folders(root.fs, root.root)]) + 1


def _version_name(version: int) -> str:
    return f"v{version}" if version else ""
