"""Checking a generation's objects with one listing of its folder: sizes from the listing, not a request per object.

It checks what :func:`.verification.stat_objects` checks (inside the root, a regular file, the manifest's size),
with the same problems. Thread-safety: a pure function of the filesystem; any thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.storage.finder import describe_entry
from lightning_async_ckpt.storage.io import same_file
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.verification import object_path

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.root import StoreRoot

__all__ = ["check_listed", "list_generation", "replaced_files"]


def list_generation(store: StoreRoot, step: int, folder: str | None = None) -> dict[str, dict[str, Any]]:
    """Every entry under generation ``step``'s folder (or ``folder``), by path relative to it, from one listing.

    A folder that does not exist lists as empty. Errors other than "not found" propagate.
    """
    folder = (folder or store.generation_path(step)).rstrip("/")
    try:
        found = store.fs.find(folder, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    marker = folder + "/"
    for name, info in found.items():
        name = str(name).rstrip("/")
        if name.startswith(marker):
            out[name[len(marker) :]] = info
            continue
        # A wrapping filesystem (faulty://, a relative local root) may list absolute names: match the folder as a
        # whole path component inside them.
        at = name.find("/" + marker)
        if at >= 0:
            out[name[at + 1 + len(marker) :]] = info
    return out


def check_listed(store: StoreRoot, manifest: Manifest) -> list[str]:
    """Problems with ``manifest``'s objects, from one listing of its generation (empty when all match).

    Each problem names the object: ``missing``, ``size X, manifest says Y``, not a regular file, outside the root,
    or the listing failed (``cannot list ...``, one problem for the generation).
    """
    # Objects spread over hashed prefixes (``root_path``) are listed with one listing per spread folder they use.
    folders = {"": None, **{o.root_path.rsplit("/", 1)[0]: None for o in manifest.objects if o.root_path}}
    listed: dict[str, dict[str, Any]] = {}
    try:
        for spread in folders:
            where = f"{store.root}/{spread}" if spread else None
            prefix = f"{spread}/" if spread else ""
            listed.update({prefix + k: v for k, v in list_generation(store, manifest.step, where).items()})
    except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
        return [f"cannot list generation step {manifest.step} ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    for obj in manifest.objects:
        try:
            object_path(store, manifest.step, obj)
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        info = listed.get(obj.root_path or obj.key)
        if info is None:
            problems.append(f"{obj.name}: missing")
        elif info.get("type") not in ("file", None):
            problems.append(f"{obj.name}: {describe_entry(info)}, not a regular file: not opened")
        elif info.get("size") != obj.size:
            problems.append(f"{obj.name}: size {info.get('size')}, manifest says {obj.size}")
    return problems


def replaced_files(folder: str, manifest: Manifest, identities: dict[str, tuple[int, int] | None]) -> list[str]:
    """Names of ``manifest``'s local objects another file now sits at (``identities``: what the writer created).

    Local disk only (an object store has no file identity; a missing file is reported by :func:`check_listed`).
    """
    changed = []
    for obj in manifest.objects:
        identity = identities.get(obj.key)
        path = f"{folder}/{obj.key}"
        if identity is not None and os.path.exists(path) and not same_file(path, identity):
            changed.append(obj.name)
    return changed
