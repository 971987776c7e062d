"""Loading a sharded generation whose data files are spread over hashed key prefixes, on any fsspec backend.

DCP's ``.metadata`` records such files as ``../spread/<h>/step-N/<file>``; object stores have no ``..``, so
:func:`storage_reader` gives DCP a reader whose joined paths are normalised first.
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


def load_generation(
    state: dict[str, Any], store: CheckpointStore, step: int, *, verify: bool = True, **kwargs: Any
) -> list[str]:
    """``dcp.load(state, ...)`` of generation ``step`` of ``store`` in place, spread data files included.

    With ``verify``, each rank first re-reads **only the objects its own load plan reads** (DCP's data files that
    hold its items, once each) against the manifest's sizes and checksums, so a job's ranks together read each
    object about once, instead of every rank verifying the whole generation.

    Args:
        state: The state dict to load into (as for ``dcp.load``).
        store: The store.
        step: A committed step.
        verify: Check the objects this rank reads before loading them.
        **kwargs: More arguments of ``dcp.load`` (``planner``, ``process_group``).

    Returns:
        The names of the objects this rank verified (empty without ``verify``).

    Raises:
        ManifestError: ``step`` is not committed, or an object this rank reads failed its size or checksum.
    """
    import torch.distributed.checkpoint as dcp

    reader = storage_reader(store, step)
    verified: list[str] = []
    failed: list[BaseException] = []
    if verify:
        plan_locally = reader.prepare_local_plan

        def prepare_local_plan(plan: Any) -> Any:
            try:
                verified.extend(_verify_read(store, step, reader, plan))
            except Exception as exc:
                failed.append(exc)
                raise
            return plan_locally(plan)

        reader.prepare_local_plan = prepare_local_plan
    try:
        dcp.load(state, storage_reader=reader, **kwargs)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if failed:  # DCP wrapped it: this rank's own verification error, as raised
            raise failed[0] from exc
        raise
    return verified


def _verify_read(store: CheckpointStore, step: int, reader: Any, plan: Any) -> list[str]:
    """Verify the objects of ``step`` that ``plan`` (this rank's load plan) reads; their names."""
    from lightning_async_ckpt.errors import ManifestError
    from lightning_async_ckpt.storage.io import Discard, read_verified
    from lightning_async_ckpt.storage.verification import object_path

    folder = reader.path
    wanted = {
        reader.fs.concat_path(folder, reader.storage_data[item.storage_index].relative_path) for item in plan.items
    }
    names = []
    for obj in store.manifest(step).objects:
        path = object_path(store.location, step, obj)
        if store.backend.url(path) not in wanted and path not in wanted:
            continue
        try:
            read_verified(store.fs, path, obj, into=Discard())
        except ManifestError as exc:
            raise ManifestError(f"generation step {step}: {obj.name} failed verification at load: {exc}") from exc
        names.append(obj.name)
    return names
