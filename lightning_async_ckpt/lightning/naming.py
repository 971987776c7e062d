"""The ground floor of ``lightning/``: what a generation is and where it lives; it imports no sibling module.

The checkpoint file is named like ``ModelCheckpoint``'s (``epoch=2-step=24.ckpt``) inside the step's folder; the
manifest lists it as object :data:`CHECKPOINT_NAME` with that key as its path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.sharded.commit import DCP_FORMAT
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.manifest import Manifest, validate_object_name
from lightning_async_ckpt.storage.root import comparable_path
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "CHECKPOINT_NAME",
    "LIGHTNING_META_NAME",
    "Location",
    "checkpoint_key",
    "comparable_path",
    "is_lightning_dcp_generation",
    "loadable_path",
    "model_key_for",
    "planned_path",
    "run_locations",
    "version_uri",
]

CHECKPOINT_NAME = "checkpoint.ckpt"
#: Lightning's metadata file beside DCP's files (``lightning.fabric.utilities.load._METADATA_FILENAME``).
LIGHTNING_META_NAME = "meta.pt"


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


def model_key_for(strategy: Any) -> str | None:
    """The key under which ``strategy`` saves the model in a DCP checkpoint, or ``None`` if it writes no DCP folder.

    ``ModelParallelStrategy`` with ``save_distributed_checkpoint=True`` saves ``state_dict``;
    ``FSDPStrategy`` with ``state_dict_type="sharded"`` saves ``model``. Detected by class name and the
    strategy's own setting, so a subclass behaves like its base.
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        return "state_dict"
    if "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", None) == "sharded":
        return "model"
    return None


def is_lightning_dcp_generation(manifest: Manifest | None) -> bool:
    """Whether a committed generation is a DCP folder Lightning's sharded strategies load (it has ``meta.pt``)."""
    return (
        manifest is not None
        and manifest.extra.get("format") == DCP_FORMAT
        and LIGHTNING_META_NAME in {o.name for o in manifest.objects}
    )


@dataclass(frozen=True)
class Location:
    """``dirpath`` (version 0) or one of its version folders, as a read-only store."""

    version: int
    store: CheckpointStore


def version_uri(dirpath: str, version: int) -> str:
    """The URL of ``dirpath``'s version ``version`` (0 is ``dirpath`` itself)."""
    return dirpath if version == 0 else f"{dirpath.rstrip('/')}/v{version}"


def run_locations(dirpath: str, storage_options: dict[str, Any] | None = None) -> list[Location]:
    """``dirpath`` and its version folders, in version order.

    Raises:
        StoreUnavailableError: ``dirpath`` cannot be listed (a local folder that does not exist is empty).
    """
    root = CheckpointStore(dirpath, storage_options, check_writable=False)
    root.scan(include_uncommitted=False)  # raises when the location cannot be listed
    locations = [Location(0, root)]
    for version in version_folders(root.fs, root.root):
        store = CheckpointStore(version_uri(dirpath, version), storage_options, check_writable=False)
        locations.append(Location(version, store))
    return locations
