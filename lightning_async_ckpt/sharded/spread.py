"""Loading a sharded generation whose data files are spread over hashed key prefixes, on any fsspec backend.

With ``CheckpointStore(hashed_prefixes=True)`` each rank's DCP data file lives at ``<root>/spread/<h>/step-N/``
(:func:`~lightning_async_ckpt.storage.manifest.spread_path`), and DCP's ``.metadata`` records it relative to the
generation folder as ``../spread/<h>/step-N/<file>``. A local path resolves ``..`` by itself, so ``dcp.load(...,
checkpoint_id=info.dcp_path)`` works there unchanged; object stores have no ``..`` (the key would be taken
literally), so :func:`storage_reader` gives DCP a reader whose joined paths are normalised first.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # torch exports it only there

    from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["load_generation", "storage_reader"]


class _Normalized:
    """DCP's fsspec file-system seam with ``..`` resolved in joined paths (every other call delegated)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def concat_path(self, path: Any, suffix: str) -> str:
        joined = posixpath.join(str(path), suffix)
        protocol, sep, rest = joined.partition("://")
        return f"{protocol}://{posixpath.normpath(rest)}" if sep else posixpath.normpath(joined)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def storage_reader(store: CheckpointStore, step: int) -> FsspecReader:
    """A DCP ``StorageReader`` of committed generation ``step`` of ``store`` (with its ``storage_options``).

    Raises:
        ManifestError: ``step`` is not committed.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # torch exports it only there

    manifest = store.manifest(step)
    folder = store.generation_path(step) + (f"/{manifest.dcp_folder}" if manifest.dcp_folder else "")
    reader = FsspecReader(store.backend.url(folder), **store.storage_options)
    reader.fs = _Normalized(reader.fs)
    return reader


def load_generation(state: dict[str, Any], store: CheckpointStore, step: int, **kwargs: Any) -> None:
    """``dcp.load(state, ...)`` of generation ``step`` of ``store`` in place, spread data files included.

    Args:
        state: The state dict to load into (as for ``dcp.load``).
        store: The store.
        step: A committed step.
        **kwargs: More arguments of ``dcp.load`` (``planner``, ``process_group``).
    """
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=storage_reader(store, step), **kwargs)
