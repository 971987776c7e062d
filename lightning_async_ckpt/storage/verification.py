"""Checking a committed generation against its manifest: where each object is, its size, and (``verify``) its bytes.

The one place that decides what "intact" means for readers. Nothing is ever unpickled.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.storage.finder import describe_entry
from lightning_async_ckpt.storage.generation import VerifyResult
from lightning_async_ckpt.storage.io import Discard, read_verified
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.root import StoreRoot

__all__ = ["object_path", "stat_objects", "verify_generation"]


def object_path(store: StoreRoot, step: int, obj: ObjectEntry) -> str:
    """Path of ``obj`` of generation ``step`` on the store's filesystem (where its manifest entry says it is: in the
    generation folder, or below the root's spread folder for an object spread over hashed prefixes).

    Raises:
        ManifestError: It resolves outside the store's root (a symlink).
    """
    path = f"{store.root}/{obj.root_path}" if obj.root_path else f"{store.generation_path(step)}/{obj.key}"
    if not store.backend.inside(path, store.root):
        raise ManifestError(f"{obj.name}: resolves outside the store root {store.uri!r} (symlink); refused")
    return path


def stat_objects(store: StoreRoot, manifest: Manifest) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Problems with the objects' existence, location, kind and sizes, and the stat of each object that matched."""
    problems: list[str] = []
    stats: dict[str, dict[str, Any]] = {}
    for obj in manifest.objects:
        try:
            info = store.fs.info(object_path(store, manifest.step, obj))
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        except FileNotFoundError:
            problems.append(f"{obj.name}: missing")
            continue
        except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
            problems.append(f"{obj.name}: cannot stat ({exc})")
            continue
        if info.get("type") not in ("file", None):
            problems.append(f"{obj.name}: {describe_entry(info)}, not a regular file: not opened")
        elif info.get("size") != obj.size:
            problems.append(f"{obj.name}: size {info.get('size')}, manifest says {obj.size}")
        else:
            stats[obj.name] = info
    return problems, stats


def verify_generation(store: StoreRoot, step: int, manifest: Manifest) -> VerifyResult:
    """Re-read every object of generation ``step`` once and check its size and checksum (see :func:`stat_objects`)."""
    problems, stats = stat_objects(store, manifest)
    for obj in manifest.objects:
        if obj.name not in stats:
            continue
        path = object_path(store, step, obj)
        try:
            opener = functools.partial(store.backend.open_read, path, stats[obj.name])  # the stat just taken
            read_verified(store.fs, path, obj, into=Discard(), opener=opener)
        except ManifestError as exc:
            problems.append(obj.name + str(exc).removeprefix(path))
        except Exception as exc:  # noqa: BLE001 - reported as a problem of this generation
            problems.append(f"{obj.name}: unreadable ({exc})")
    return VerifyResult(step=step, ok=not problems, problems=tuple(problems))
