"""Resuming: the newest checkpoint that is provably intact, and opening it with the store's ``storage_options``.

Lightning opens ``ckpt_path`` with a filesystem built from the path alone, so from ``setup`` until ``teardown`` the
callback routes loads inside ``dirpath`` through a :class:`StoreReader` with the store's options; for a remote
``dirpath`` ``ckpt_path="last"`` is answered with an in-memory marker that the reader loads from the store. Once
loaded, ``trainer.ckpt_path`` names the checkpoint read (the store URL, never the marker).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_async_ckpt.lightning.arguments import resolve_dirpath
from lightning_async_ckpt.lightning.last import warn_if_weights_only, weights_only
from lightning_async_ckpt.lightning.naming import CHECKPOINT_NAME, is_lightning_dcp_generation, loadable_path
from lightning_async_ckpt.lightning.store_reader import StoreReader
from lightning_async_ckpt.sharded.once import job_broadcast, lightning_broadcast, once
from lightning_async_ckpt.storage import inflight
from lightning_async_ckpt.storage.lookup import newest_intact, warn_if_nested
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "StoreReader",
    "committed_steps_once",
    "find_last",
    "install_reader",
    "latest_checkpoint",
    "name_loaded_checkpoint",
    "remove_reader",
    "resumed_from",
]

_log = logging.getLogger("lightning_async_ckpt")
_READER_ATTR = "_lightning_async_ckpt_reader"


def latest_checkpoint(
    dirpath: str, storage_options: dict[str, Any] | None = None, *, collective: bool = True
) -> str | None:
    """Path of the newest committed, intact, Lightning-loadable checkpoint under ``dirpath``, or ``None``.

    **Once per job.** Under an initialized ``torch.distributed`` group of more than one rank, only rank 0 lists the
    store, reads manifests and verifies the choice; the path (or rank 0's error, raised on every rank) is
    broadcast (:func:`~lightning_async_ckpt.sharded.once.once`). Every rank must therefore call it together, as a
    script run on every rank does; with a non-gloo default group (NCCL) the first call creates a gloo group (a
    collective). ``collective=False`` looks on this rank alone (a call made on some ranks only).

    The generation returned was verified (every object read once against its size and checksum); one that fails is
    skipped with a warning and the next older one is tried. ``dirpath``'s version folders (``<dirpath>/v1``, ...)
    are included: the newest version holding one wins, and within a folder the highest step, never the writers'
    clocks. Use it as ``trainer.fit(model, ckpt_path=latest_checkpoint(dirpath, storage_options))`` with an
    ``AsyncCheckpointCallback`` for the same ``dirpath`` in the Trainer.

    Args:
        dirpath: The callback's ``dirpath`` (local folder or fsspec URL).
        storage_options: fsspec options for ``dirpath``.
        collective: Under a process group, find on rank 0 and broadcast (``False``: every caller looks itself).

    Returns:
        The URL of the checkpoint object, or ``None`` when ``dirpath`` was listed and holds no intact
        checkpoint (a local folder that does not exist yet is empty); a warning names its subfolders when they
        hold checkpoints (a path given one level too high).

    Raises:
        StoreUnavailableError: ``dirpath`` cannot be listed (missing bucket, unreachable endpoint, no
            permission): a typo never silently restarts training from scratch.
        StorageError: Generations kept vanishing under the reader (a writer's retention outran every relisting).
    """
    inflight.wait_for(dirpath, storage_options, doing="latest checkpoint of")  # this process's saves land first

    def find() -> str | None:
        path = _newest_verified(dirpath, storage_options)
        if path is None:
            warn_if_nested(dirpath, storage_options, stacklevel=5)
        return path

    return once(find, broadcast=job_broadcast() if collective else None, doing=f"latest_checkpoint({dirpath!r})")


def _newest_verified(dirpath: str, storage_options: dict[str, Any] | None, *, resumable: bool = False) -> str | None:
    inflight.wait_for(dirpath, storage_options, doing="latest checkpoint of")  # this process's saves land first

    def accept(manifest: Any) -> bool:
        return _loadable(manifest, CHECKPOINT_NAME) and not (resumable and weights_only(manifest))

    def skip(url: str, problems: tuple[str, ...]) -> None:
        message = f"skipping generation {url}: {'; '.join(problems)}"
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=4)

    # One listing per folder, manifests newest first (issue 27): O(1) manifest reads when the newest is intact.
    found = newest_intact(dirpath, storage_options, accept=accept, on_skip=skip)
    return None if found is None else loadable_path(found.manifest, found.store)


def _loadable(manifest: Any, name: str) -> bool:
    """Whether Lightning can resume from a committed generation: its checkpoint file, or a sharded (DCP) folder.

    A DCP generation written by ``AsyncCheckpointCallback`` under ``ModelParallelStrategy``/``FSDPStrategy``
    holds DCP's files and ``meta.pt``; those strategies load the generation folder (see ``lightning/sharded.py``).
    """
    return name in {o.name for o in manifest.objects} or is_lightning_dcp_generation(manifest)


def _dirpath(callback: Any, trainer: Any) -> str:
    return resolve_dirpath(callback.dirpath, trainer.default_root_dir)


def _reader(callback: Any, dirpath: str) -> StoreReader:
    reader = getattr(callback, _READER_ATTR, None)
    if reader is None or reader.dirpath != dirpath or reader.storage_options != callback.storage_options:
        if reader is not None:
            reader.remove()
        reader = StoreReader(dirpath, callback.storage_options)
        setattr(callback, _READER_ATTR, reader)
    # The class attributes a user may set, like ModelCheckpoint's (read at each lookup).
    reader.last_name, reader.last_extension = callback.CHECKPOINT_NAME_LAST, callback.FILE_EXTENSION
    return reader


def find_last(callback: Any, trainer: Any) -> set[str]:
    """Lightning's ``ckpt_path="last"`` lookup for ``callback``: the newest committed checkpoint only.

    A store that cannot be listed raises (a typo must never restart training from scratch). With several ranks, rank 0
    alone lists and verifies, and ``trainer.strategy.broadcast`` hands its answer (or its error) to the others.
    """
    reader = _reader(callback, _dirpath(callback, trainer))
    find = lambda: _last_candidates(callback, trainer)  # noqa: E731 - rank 0 lists and verifies, the others receive
    newest, legacy = once(find, broadcast=lightning_broadcast(trainer), doing="resolving ckpt_path='last'")
    if newest is None:
        return set()
    reader.offered.add(newest)
    if reader.remote:
        alias = reader.alias(newest)  # an in-memory marker: each process makes its own
        reader.offered.add(alias)
        return {alias}
    # Local: every candidate, like ModelCheckpoint's lookup; Lightning resumes from the most recently written one,
    # which is `newest` (the same rule).
    return {newest, *legacy}


def committed_steps_once(store: CheckpointStore, trainer: Any) -> set[int]:
    """The steps committed in ``store``, listed and read on rank 0 only and broadcast to every rank.

    For a setup that runs on every rank (``setup_sharded``): one rank reads the manifests instead of all of them.
    A collective through ``trainer.strategy.broadcast``: call it on every rank; rank 0's error is raised everywhere.
    """
    return once(
        lambda: {g.step for g in store.generations()},
        broadcast=lightning_broadcast(trainer),
        doing=f"listing the committed steps of {store.uri}",
    )


def _last_candidates(callback: Any, trainer: Any) -> tuple[str | None, list[str]]:
    """What "last" resumes from, and ``ModelCheckpoint``'s last files beside it (one listing of each folder)."""
    dirpath = _dirpath(callback, trainer)
    # The callback's own dirpath, not a guess at one: a nested callback's folder below it is not a mistake.
    path = _newest_verified(dirpath, callback.storage_options, resumable=True)
    reader = _reader(callback, dirpath)
    # A ModelCheckpoint that wrote to this dirpath before this callback replaced it: its `last*.ckpt` is what "last"
    # resumed from then, so it stays a candidate; the most recently written one wins, as in Lightning's lookup.
    legacy = reader.model_checkpoint_last_files()
    candidates = ([path] if path is not None else []) + legacy
    if not candidates:
        warn_if_weights_only(dirpath, callback.storage_options)  # only weights-only generations: say so (last.py)
        return None, []
    newest = max(candidates, key=reader.modified) if len(candidates) > 1 else candidates[0]
    if newest in legacy:
        _log.warning("ckpt_path='last' resumes from %s, written by ModelCheckpoint (no manifest verifies it)", newest)
    return newest, legacy


def install_reader(callback: Any, trainer: Any) -> None:
    """From ``setup``: load checkpoints inside the callback's ``dirpath`` through its store (remote stores), and a
    missing ``<dirpath>/last.ckpt`` as ``ckpt_path="last"`` (any store)."""
    reader = _reader(callback, _dirpath(callback, trainer))
    reader.install(trainer.strategy.checkpoint_io, newest=lambda: _last_candidates(callback, trainer)[0])


def name_loaded_checkpoint(callback: Any, trainer: Any) -> None:
    """From ``on_load_checkpoint``: ``trainer.ckpt_path`` names the checkpoint read (the store URL behind a
    ``"last"`` marker, or what a missing ``<dirpath>/last.ckpt`` stood for), as Lightning's own log line then does."""
    reader = getattr(callback, _READER_ATTR, None)
    if reader is not None and reader.loaded is not None and str(trainer.ckpt_path) != reader.loaded:
        trainer._checkpoint_connector._ckpt_path = reader.loaded


def resumed_from(callback: Any, trainer: Any) -> str | None:
    """The checkpoint this fit restored, as a URL or local path (the real object behind a ``"last"`` marker)."""
    reader = getattr(callback, _READER_ATTR, None)
    if reader is not None and reader.loaded is not None:
        return reader.loaded
    return None if trainer.ckpt_path is None else str(trainer.ckpt_path)


def remove_reader(callback: Any) -> None:
    """From ``teardown``: give the strategy's checkpoint IO back its own loader."""
    reader = getattr(callback, _READER_ATTR, None)
    if reader is not None:
        reader.remove()
