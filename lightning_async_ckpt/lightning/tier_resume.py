"""Resuming across tiers: the newest verified generation of ``dirpath`` or of the node-local tier.

:func:`latest_checkpoint` with ``local_dirpath`` and ``ckpt_path="last"`` of a callback with ``local_dirpath``
(:func:`find_last_across`) take the local generation when it is at least as new as every durable one and intact,
else the durable one; ranks agree on one step (across nodes, with peer replicas, and for DCP generations through
:mod:`~lightning_async_ckpt.lightning.sharded_tiers`).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.lightning import resume
from lightning_async_ckpt.lightning.arguments import resolve_dirpath
from lightning_async_ckpt.lightning.last import weights_only
from lightning_async_ckpt.lightning.naming import CHECKPOINT_NAME, loadable_path, version_uri
from lightning_async_ckpt.lightning.replicas import agree_on_local
from lightning_async_ckpt.lightning.sharded_tiers import find_last_sharded
from lightning_async_ckpt.lightning.sliced import writes_sharded
from lightning_async_ckpt.storage.finder import durable_step_to_beat, list_steps, newest_committed_above
from lightning_async_ckpt.storage.lookup import newest_intact
from lightning_async_ckpt.storage.root import StoreRoot
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.replica_persist import manifest_of

__all__ = ["find_last_across", "latest_checkpoint"]

_log = logging.getLogger("lightning_async_ckpt")
_STEP_IN_PATH = re.compile(r"step-(\d{8,})(?:/|$)")


@dataclass(frozen=True)
class _Local:
    step: int
    path: str
    version: int = 0


# -- resuming across tiers ---------------------------------------------------------------------------------
def latest_checkpoint(
    dirpath: str,
    storage_options: dict[str, Any] | None = None,
    *,
    local_dirpath: str | None = None,
    collective: bool = True,
) -> str | None:
    """Path of the newest committed, verified checkpoint of ``dirpath`` or, with ``local_dirpath``, of either tier.

    Without ``local_dirpath`` this is :func:`lightning_async_ckpt.lightning.resume.latest_checkpoint`. With it, the
    local tier's newest intact generation (every object re-read against its checksum) is returned when no
    generation of ``dirpath`` is newer (``dirpath`` is then only listed, never read); otherwise, or when the local
    tier is missing or damaged, the newest verified generation of ``dirpath``.

    Args:
        dirpath: The durable tier (the callback's ``dirpath``), a local folder or fsspec URL.
        storage_options: fsspec options for ``dirpath``.
        local_dirpath: The callback's ``local_dirpath``.
        collective: Without ``local_dirpath``, under a process group: rank 0 finds, every rank gets its answer
            (``False``: this rank looks alone). With ``local_dirpath`` every process answers for its own node-local
            tier and looks alone (a lookup on some ranks only must never wait for the others).

    Raises:
        StoreUnavailableError: ``dirpath`` cannot be listed.
    """
    if local_dirpath is None:
        return resume.latest_checkpoint(dirpath, storage_options, collective=collective)
    local = _newest_local(local_dirpath, resumable=False)
    if local is not None and not _durable_newer(dirpath, storage_options, local.step):
        return local.path
    durable = resume.latest_checkpoint(dirpath, storage_options, collective=False)
    return _pick(local, {durable} if durable else set(), single=True)


def find_last_across(callback: Any, trainer: Any) -> set[str]:
    """``ckpt_path="last"`` of a callback with ``local_dirpath``: :func:`latest_checkpoint`'s rule, resumable
    generations only (never ``save_weights_only`` ones). With ``replicas`` every rank agrees on one step, and a rank
    whose local tier lacks it gets it from a peer first (:mod:`~lightning_async_ckpt.lightning.replicas`)."""
    if writes_sharded(callback, trainer):  # DCP generations: every rank agrees (lightning/sharded_tiers.py)
        return find_last_sharded(callback, trainer)
    dirpath = resolve_dirpath(callback.dirpath, trainer.default_root_dir)
    if callback.tiers.replicas and trainer.world_size > 1:
        return _find_last_replicated(callback, trainer, dirpath)
    local = _agreed(trainer, _newest_local(callback.local_dirpath, resumable=True))
    durable = resume.find_last(callback, trainer)  # on every rank: a collective once the process group exists
    if local is not None and not _durable_newer(dirpath, callback.storage_options, local.step):
        _log.info("ckpt_path='last' resumes from the local tier: %s", local.path)
        return {local.path}
    return _pick(local, durable, single=False)


def _find_last_replicated(callback: Any, trainer: Any, dirpath: str) -> set[str]:
    local = _newest_local(callback.local_dirpath, resumable=True)
    durable = durable_step_to_beat(_durable_stores(dirpath, callback.storage_options), local and local.step)
    agreed = agree_on_local(
        callback.tiers,
        trainer,
        newest_local=None if local is None else (local.version, local.step),
        durable_step=durable,
        store_of=lambda version: CheckpointStore(version_uri(callback.local_dirpath, version), check_writable=False),
    )
    if agreed is None:
        _log.info("ckpt_path='last': every rank resumes from dirpath (no local generation newer on any rank)")
        return resume.find_last(callback, trainer)
    store = CheckpointStore(version_uri(callback.local_dirpath, agreed[0]), check_writable=False)
    path = loadable_path(manifest_of(store, agreed[1]), store)
    _log.info("ckpt_path='last' resumes from the local tier (agreed by every rank): %s", path)
    return {path}


def _agreed(trainer: Any, local: _Local | None) -> _Local | None:
    """Every rank must resume from the same generation, and Lightning resolves ``"last"`` on each rank before any
    collective exists. On one node the ranks read the same node-local folder, so they agree; across nodes only rank
    0's node holds the local generations (no peer replicas yet), so every rank resumes from ``dirpath`` together."""
    if local is not None and trainer.num_nodes > 1:
        _log.info("ckpt_path='last': %d nodes; resuming from dirpath, not from the node-local tier", trainer.num_nodes)
        return None
    return local


def _pick(local: _Local | None, durable: set[str], *, single: bool) -> Any:
    steps = [_step_of(p) for p in durable]
    newest = max((s for s in steps if s is not None), default=-1)
    if local is not None and local.step >= newest:
        return local.path if single else {local.path}
    if single:
        return next(iter(durable), None)
    return durable


def _step_of(path: str) -> int | None:
    found = _STEP_IN_PATH.findall(path)
    return int(found[-1]) if found else None


def _durable_newer(dirpath: str, storage_options: dict[str, Any] | None, step: int) -> bool:
    """Whether ``dirpath`` or a version of it holds a committed generation newer than ``step`` (a listing; only
    manifests of steps listed above ``step`` are read)."""
    return newest_committed_above(_durable_stores(dirpath, storage_options), step) is not None


def _durable_stores(dirpath: str, storage_options: dict[str, Any] | None) -> list[StoreRoot]:
    """Where ``dirpath`` and its version folders live."""
    root = CheckpointStore(dirpath, storage_options, check_writable=False).location
    versions = list_steps(root).versions
    return [
        root,
        *(CheckpointStore(version_uri(dirpath, v), storage_options, check_writable=False).location for v in versions),
    ]


def _newest_local(local_dirpath: str, *, resumable: bool) -> _Local | None:
    def accept(manifest: Any) -> bool:
        has_file = any(o.name == CHECKPOINT_NAME for o in manifest.objects)
        return has_file and not (resumable and weights_only(manifest))

    def skip(url: str, problems: tuple[str, ...]) -> None:
        message = f"skipping local generation {url}: {'; '.join(problems)}"
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=4)

    found = newest_intact(local_dirpath, None, accept=accept, on_skip=skip)
    if found is None:
        return None
    return _Local(found.info.step, loadable_path(found.manifest, found.store), found.version)
