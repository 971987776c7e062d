"""Where the callback's checkpoint file of a generation lives: its object key, and its loadable path.

The file is named like ``ModelCheckpoint``'s (``epoch=2-step=24.ckpt``) inside the step's folder, so tools that key
on file names (MLflow's model upload) tell generations apart; the manifest lists it as object
:data:`CHECKPOINT_NAME` with that key as its path.
"""

from __future__ import annotations

from typing import Any

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.lightning.sharded import is_lightning_dcp_generation
from lightning_async_ckpt.storage.manifest import validate_object_name
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["CHECKPOINT_NAME", "checkpoint_key", "loadable_path", "planned_path"]

CHECKPOINT_NAME = "checkpoint.ckpt"


def checkpoint_key(filename: str, extension: str) -> str | None:
    """The object key for a rendered ``filename``, or ``None`` when it is not a plain file name (a ``/`` in the
    template, a reserved prefix): the file then keeps :data:`CHECKPOINT_NAME`."""
    key = str(filename)
    if not key.endswith(extension):
        key += extension
    try:
        if "/" in validate_object_name(key) or key.startswith(("w-", ".")):
            return None
    except ManifestError:
        return None
    return key


def loadable_path(manifest: Any, store: CheckpointStore) -> str:
    """The path Lightning loads a committed generation from: its checkpoint file, or for a sharded (DCP)
    generation the folder the strategy loads (lightning/sharded.py)."""
    if is_lightning_dcp_generation(manifest):
        return store.url(manifest.step)
    return store.url(manifest.step, manifest.object(CHECKPOINT_NAME).key)


def planned_path(store: CheckpointStore | None, step: int, key: str | None, *, sharded: bool) -> str:
    """:func:`loadable_path` of ``step`` before it is committed (``""`` on a rank that writes nothing)."""
    if store is None:
        return ""
    return store.url(step) if sharded else store.url(step, key or CHECKPOINT_NAME)
