"""The coordinator's commit of a sharded generation: ``manifest.json`` last, listing every rank's objects.

It runs inside DCP's ``finish`` (after every rank's ``write_data`` succeeded and ``.metadata`` is durable) through the
single-writer claim's ``commit``. The manifest's ``extra`` says ``format == "torch_dcp"``, ``ranks`` (rank -> object
names), ``dcp_folder`` and ``write_retries``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.writer import GenerationWriter

__all__ = ["DCP_FORMAT", "RankObjects", "commit_generation"]

#: ``Manifest.extra["format"]`` of a generation in torch DCP's format.
DCP_FORMAT = "torch_dcp"


@dataclass(frozen=True, kw_only=True)
class RankObjects:
    """What one rank wrote into a generation: sent to the coordinator inside DCP's gather of write results.

    Attributes:
        rank: The rank in the checkpoint's process group.
        objects: The rank's data objects with sizes and checksums.
        retries: Writes this rank retried because the store throttled it (:mod:`.write_retry`).
    """

    rank: int
    objects: tuple[ObjectEntry, ...]
    retries: int = 0


def commit_generation(
    claim: GenerationWriter,
    reports: Sequence[RankObjects],
    *,
    cut: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Write the manifest of a sharded generation last and exclusively, through the claim's ``commit``.

    Args:
        claim: The coordinator's claim on the step (from ``CheckpointStore.begin``); it wrote no objects itself.
            With a prefix (another writer held the step), every object was written under that prefix.
        reports: Every rank's objects (rank ``-1``: the coordinator's DCP ``.metadata``).
        cut: What the cut was (``step`` and ``world_size`` are filled in).
        extra: More free-form metadata for ``Manifest.extra``.

    Returns:
        The committed manifest.

    Raises:
        StorageError: Two ranks reported the same object, an object is missing or has another size than reported
            (before or after the manifest was written; the manifest is removed again), or the manifest cannot be
            written. The step is not committed.
        GenerationExistsError: Another writer committed the step first (this save's objects were removed).
    """
    ranks: dict[str, list[str]] = {}
    retries: dict[str, int] = {}  # throttled writes each rank retried (:mod:`.write_retry`)
    seen: set[str] = set()
    for report in reports:
        for entry in report.objects:
            if entry.name in seen:
                claim.abort()
                raise StorageError(
                    f"object {entry.name!r} of step {claim.step} was reported by two ranks; not committing"
                )
            seen.add(entry.name)
        if report.rank >= 0:
            ranks[str(report.rank)] = [entry.name for entry in report.objects]
            retries[str(report.rank)] = report.retries
    for report in reports:
        for entry in report.objects:
            claim.record(entry)
    return claim.commit(
        cut={"step": claim.step, "world_size": len(ranks), **(cut or {})},
        extra={
            "format": DCP_FORMAT,
            "ranks": ranks,
            "dcp_folder": claim.prefix.rstrip("/"),
            "write_retries": retries,
            **(extra or {}),
        },
    )
