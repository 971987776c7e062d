"""Which tier :func:`~lightning_async_ckpt.accelerate.load_state` restores from with ``local_dirpath``.

Every process looks at its own local tier (a node-local folder: other nodes' folders hold nothing unless they are
shared or replicated), so every process takes part in the one cross-tier resume
(:mod:`~lightning_async_ckpt.tiers.resume`): every process loads one step from its own folder when every process holds
it intact (with replicas attached: a process lacking it receives it from a peer first) and ``uri`` holds no newer
committed generation; otherwise every process falls back to ``uri`` together (the main process chooses there, as
with one tier).
"""

from __future__ import annotations

from typing import Any

from lightning_async_ckpt.accelerate._choose import Choice
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.replica_persist import manifest_of
from lightning_async_ckpt.tiers.resume import OneStream, durable_roots, pick_local, pick_with_peers

__all__ = ["accept_accelerate", "choose_across_tiers"]


def choose_across_tiers(
    collective: Any,
    uri: str,
    local_dirpath: str,
    options: dict[str, Any],
    step: int | None,
    replicas: Any = None,
) -> Choice | None:
    """Collective: this process's local generation every process agreed on, or ``None`` (every process loads from
    ``uri``). With ``step``: that step, from the local tier when every process holds it intact.

    Raises:
        RankFailedError: Another process failed to look (its error is raised there).
        StoreUnavailableError: ``uri`` cannot be listed.
        ReplicaError: With ``replicas``: a copy from a peer failed (on every process).
    """
    durable = CheckpointStore(uri, options, check_writable=False)
    tier = OneStream(local_dirpath, durable, accept_accelerate, step)
    roots = [] if step is not None else durable_roots(durable)  # an asked-for step is never outranked
    if replicas is not None:
        if replicas.group is None:
            raise CheckpointError("the replicas of this checkpointer were closed; attach() a new one")
        local = pick_with_peers(replicas.group, tier, roots, collective=collective)
    else:
        local = pick_local(tier, roots, collective=collective, doing="load_state")
    if local is None or local.beaten_by is not None:
        return None
    manifest = manifest_of(local.store, local.step) if replicas is not None else None
    return Choice(url=local.store.url(local.step), step=local.step, manifest=manifest)


def accept_accelerate(manifest: Manifest) -> bool:
    """Whether a local generation is one of accelerate's layout (the only kind ``load_state`` restores)."""
    return manifest.extra.get("layout") == "accelerate"
