"""A receiver's held copy of an offered generation: re-verified before "have it", repaired write-once when damaged.

:func:`held_copy` says what a folder holds of an offered generation (nothing, an intact copy: every byte re-read,
a damaged copy, or another generation of that step). A damaged committed copy is never overwritten:
:func:`repair_where` names a new version folder for the fresh copy (``v<k>/`` before the layout's folder), unless a
newer one already holds an intact copy.
"""

from __future__ import annotations

import enum
import logging

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.storage.generation import VERSION_RE, version_folders
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["Held", "held_copy", "repair_where"]

_log = logging.getLogger("lightning_async_ckpt")


class Held(enum.Enum):
    """What a receiving folder holds of an offered generation."""

    NONE = "none"
    INTACT = "intact"
    DAMAGED = "damaged"
    OTHER = "other"


def held_copy(store: CheckpointStore, manifest: Manifest) -> tuple[Held, str]:
    """What ``store`` holds of the generation ``manifest`` describes, and why (the problems of a damaged copy).

    An intact copy has the same objects (names, sizes, checksums) and every byte re-read matches them.
    """
    step = manifest.step
    try:
        existing = store.manifest(step)
    except (ManifestError, FileNotFoundError):
        return Held.NONE, ""
    if _objects(existing) != _objects(manifest):
        return Held.OTHER, f"{store.uri} holds another step {step}"
    try:
        result = store.verify(step, manifest=existing)
        problems = "" if result.ok else "; ".join(result.problems) or "failed verification"
    except Exception as exc:  # noqa: BLE001 - a copy that cannot be re-read is no copy to rely on
        problems = f"{type(exc).__name__}: {exc}"
    if not problems:
        return Held.INTACT, ""
    store.invalidate_cache()
    try:
        store.manifest(step)
    except (ManifestError, FileNotFoundError):  # removed meanwhile (retention): nothing is held
        return Held.NONE, ""
    return Held.DAMAGED, problems


def repair_where(root: str, where: str, manifest: Manifest) -> tuple[str, bool]:
    """Where, relative to local tier ``root``, a fresh copy of the generation damaged in folder ``where`` goes, and
    whether an intact copy is there already (a newer version folder holding the same relative folder).

    ``where`` is ``""`` / ``"v<k>"`` (a version folder) or ``"[v<k>/]<folder>"`` (a layout's folder in it); the
    answer keeps ``<folder>`` under the first version folder after every one ``root`` has.
    """
    head, _, rest = where.partition("/")
    match = VERSION_RE.match(head)
    version, rest = (int(match.group(1)), rest) if match else (0, where)
    listing = CheckpointStore(root, check_writable=False)
    versions = version_folders(listing.fs, listing.root)
    for newer in (v for v in versions if v > version):
        candidate = _join(newer, rest)
        store = CheckpointStore(_uri(root, candidate), run_id=manifest.run_id, check_writable=False)
        if held_copy(store, manifest)[0] is Held.INTACT:
            return candidate, True
    return _join(max([version, *versions]) + 1, rest), False


def _join(version: int, rest: str) -> str:
    return f"v{version}/{rest}" if rest else f"v{version}"


def _uri(root: str, where: str) -> str:
    return f"{root.rstrip('/')}/{where}"


def _objects(manifest: Manifest) -> list[tuple[str, int, str]]:
    return [(o.name, o.size, o.checksum) for o in manifest.objects]
