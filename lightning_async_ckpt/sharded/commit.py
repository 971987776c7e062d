"""The coordinator's commit of a sharded generation: ``manifest.json`` last, listing every rank's objects.

Runs inside DCP's ``finish`` on the coordinator, which DCP calls only after every rank's ``write_data`` succeeded
and after DCP's ``.metadata`` is durable. The manifest is the same schema as a single-writer generation's
(:class:`~lightning_async_ckpt.storage.manifest.Manifest`), so ``CheckpointStore.generations``, ``latest``,
``verify`` and retention read sharded generations unchanged; ``extra["format"] == "torch_dcp"`` and
``extra["ranks"]`` (rank -> object names) say what it is.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import GenerationExistsError, StorageError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest, ObjectEntry

if TYPE_CHECKING:
    from lightning_async_ckpt.sharded.dcp_writer import RankObjects
    from lightning_async_ckpt.storage.writer import GenerationWriter

__all__ = ["DCP_FORMAT", "commit_generation"]

#: ``Manifest.extra["format"]`` of a generation in torch DCP's format.
DCP_FORMAT = "torch_dcp"


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("lightning_async_ckpt", "torch", "lightning", "fsspec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def commit_generation(
    claim: GenerationWriter,
    reports: Sequence[RankObjects],
    *,
    cut: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Write the manifest of a sharded generation last and exclusively.

    Args:
        claim: The coordinator's claim on the step (from ``CheckpointStore.begin``); it wrote no objects itself.
        reports: Every rank's objects (rank ``-1``: the coordinator's DCP ``.metadata``).
        cut: What the cut was (``step`` and ``world_size`` are filled in).
        extra: More free-form metadata for ``Manifest.extra``.

    Returns:
        The committed manifest.

    Raises:
        StorageError: Two ranks reported the same object, an object is missing or has another size than reported
            (before or after the manifest was written; the manifest is removed again), or the manifest cannot be
            written. The step is not committed.
        GenerationExistsError: Another writer committed the step first.
    """
    store = claim.store
    step = claim.step
    objects: dict[str, ObjectEntry] = {}
    ranks: dict[str, list[str]] = {}
    for report in reports:
        for entry in report.objects:
            if entry.name in objects:
                raise StorageError(f"object {entry.name!r} of step {step} was reported by two ranks; not committing")
            objects[entry.name] = entry
        if report.rank >= 0:
            ranks[str(report.rank)] = [entry.name for entry in report.objects]
    world_size = len(ranks)
    manifest = Manifest(
        step=step,
        run_id=store.run_id,
        objects=tuple(objects[name] for name in sorted(objects)),
        cut={"step": step, "world_size": world_size, **(cut or {})},
        versions=_versions(),
        extra={"format": DCP_FORMAT, "ranks": ranks, **(extra or {})},
        committed_at=time.time(),
    )
    _check(store, manifest, "before")
    path = f"{claim.path}/{MANIFEST_NAME}"
    try:
        store.backend.create_exclusive(path, manifest.to_json())
    except FileExistsError as exc:
        raise GenerationExistsError(
            f"generation step {step} at {store.url(step)} was committed by another writer first"
        ) from exc
    except Exception as exc:
        raise StorageError(f"could not write manifest {path!r}: {exc}") from exc
    try:
        store.backend.sync_folder(store.root)
        _check(store, manifest, "after")
    except BaseException:
        try:
            store.fs.rm_file(path)
        except Exception:  # noqa: BLE001 - the raised error says the step is not committed
            pass
        raise
    finally:
        store.invalidate_cache()
    store.end_write(step)
    return manifest


def _check(store: Any, manifest: Manifest, when: str) -> None:
    problems = store.check_sizes(manifest)
    if problems:
        raise StorageError(
            f"generation step {manifest.step} at {store.url(manifest.step)}: objects differ from what the ranks "
            f"reported {when} the manifest was written ({'; '.join(problems)}). The step is NOT committed"
        )
