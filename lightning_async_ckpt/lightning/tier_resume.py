"""Resuming across tiers in Lightning: the newest verified generation of ``dirpath`` or of the node-local tier.

:func:`latest_checkpoint` with ``local_dirpath`` and ``ckpt_path="last"`` of a callback with ``local_dirpath``
(:func:`find_last_across`) decide by the one cross-tier resume (:mod:`~lightning_async_ckpt.tiers.resume`): the local
generation when intact and no newer one is committed on ``dirpath``, else the durable one; ranks agree on one step
(across nodes, with peer replicas, and for DCP generations through
:mod:`~lightning_async_ckpt.lightning.sharded_tiers`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from lightning_async_ckpt.lightning import resume
from lightning_async_ckpt.lightning.arguments import resolve_dirpath
from lightning_async_ckpt.lightning.last import weights_only
from lightning_async_ckpt.lightning.naming import CHECKPOINT_NAME, loadable_path
from lightning_async_ckpt.lightning.replicas import ensure_group
from lightning_async_ckpt.lightning.sharded_tiers import find_last_sharded
from lightning_async_ckpt.lightning.sliced import writes_sharded
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.replica_persist import manifest_of
from lightning_async_ckpt.tiers.resume import Local, OneStream, keeps_local, pick_local, pick_with_peers

__all__ = ["find_last_across", "latest_checkpoint"]

_log = logging.getLogger("lightning_async_ckpt")
_STEP_IN_PATH = re.compile(r"step-(\d{8,})(?:/|$)")


def latest_checkpoint(
    dirpath: str,
    storage_options: dict[str, Any] | None = None,
    *,
    local_dirpath: str | None = None,
    collective: bool = True,
) -> str | None:
    """Path of the newest committed, verified checkpoint of ``dirpath`` or, with ``local_dirpath``, of either tier.

    Without ``local_dirpath`` this is :func:`lightning_async_ckpt.lightning.resume.latest_checkpoint`. With it, the
    local tier's newest intact generation of this run (every object re-read against its checksum) is returned when
    ``dirpath`` holds no newer committed generation (``dirpath`` is then only listed, never read); otherwise, or
    when the local tier is missing or damaged, the newest verified generation of ``dirpath``.

    Args:
        dirpath: The durable tier (the callback's ``dirpath``), a local folder or fsspec URL.
        storage_options: fsspec options for ``dirpath``.
        local_dirpath: The callback's ``local_dirpath``.
        collective: Without ``local_dirpath``, under a process group: rank 0 finds, every rank gets its answer
            (``False``: this rank looks alone). With ``local_dirpath`` every process answers for its own node-local
            tier and looks alone (a lookup on some ranks only must never wait for the others).

    Raises:
        StoreUnavailableError: ``dirpath`` cannot be listed.
        ConfigError: ``local_dirpath`` holds generations of several runs and ``dirpath`` names none of them.
    """
    if local_dirpath is None:
        return resume.latest_checkpoint(dirpath, storage_options, collective=collective)
    durable = CheckpointStore(dirpath, storage_options, check_writable=False)
    local = pick_local(_tier(local_dirpath, durable, resumable=False), durable)
    if local is not None and local.beaten_by is None:
        return _path(local)  # dirpath only listed
    found = resume.latest_checkpoint(dirpath, storage_options, collective=False)
    return _pick(local, {found} if found else set(), single=True)


def find_last_across(callback: Any, trainer: Any) -> set[str]:
    """``ckpt_path="last"`` of a callback with ``local_dirpath``: :func:`latest_checkpoint`'s rule, resumable
    generations only (never ``save_weights_only`` ones). With ``replicas`` every rank agrees on one step, and a rank
    whose local tier lacks it gets it from a peer first (:mod:`~lightning_async_ckpt.lightning.replicas`)."""
    if writes_sharded(callback, trainer):  # DCP generations: every rank agrees (lightning/sharded_tiers.py)
        return find_last_sharded(callback, trainer)
    durable = CheckpointStore(
        resolve_dirpath(callback.dirpath, trainer.default_root_dir), callback.storage_options, check_writable=False
    )
    tier = _tier(callback.local_dirpath, durable, resumable=True)
    if callback.tiers.replicas and trainer.world_size > 1:
        local = pick_with_peers(ensure_group(callback.tiers, trainer), tier, durable)
        if local is None:
            _log.info("ckpt_path='last': every rank resumes from dirpath (no local generation newer on any rank)")
            return resume.find_last(callback, trainer)
        _log.info("ckpt_path='last' resumes from the local tier (agreed by every rank): %s", local.store.uri)
        return {loadable_path(manifest_of(local.store, local.step), local.store)}
    # Lightning resolves "last" on each rank before any collective exists. On one node the ranks read the same
    # node-local folder, so they agree; across nodes only rank 0's node holds the local generations (no peer
    # replicas), so every rank resumes from dirpath together.
    local = pick_local(tier, durable) if trainer.num_nodes <= 1 else None
    if trainer.num_nodes > 1:
        _log.info("ckpt_path='last': %d nodes; resuming from dirpath, not from the node-local tier", trainer.num_nodes)
    found = resume.find_last(callback, trainer)  # on every rank: a collective once the process group exists
    return _pick(local, found, single=False)


def _tier(local_dirpath: str, durable: CheckpointStore, *, resumable: bool) -> OneStream:
    """The local tier of Lightning's generations of this run: a checkpoint file, loadable (``resumable``: not
    ``save_weights_only``)."""

    def accept(manifest: Any) -> bool:
        has_file = any(o.name == CHECKPOINT_NAME for o in manifest.objects)
        return has_file and not (resumable and weights_only(manifest))

    return OneStream(local_dirpath, durable, accept)


def _path(local: Local) -> str:
    return loadable_path(local.store.manifest(local.step), local.store)


def _pick(local: Local | None, durable: set[str], *, single: bool) -> Any:
    """The durable answer, unless the local generation is kept (:func:`~lightning_async_ckpt.tiers.resume.keeps_local`)."""
    newest = max((s for s in map(_step_of, durable) if s is not None), default=None)
    if keeps_local(local, newest):
        assert local is not None
        return _path(local) if single else {_path(local)}
    return next(iter(durable), None) if single else durable


def _step_of(path: str) -> int | None:
    found = _STEP_IN_PATH.findall(path)
    return int(found[-1]) if found else None
