"""Listing and verifying accelerate's checkpoint folders (what ``lightning-async-ckpt ls`` / ``verify`` read).

Example:
    >>> from lightning_async_ckpt.accelerate.folders import accelerate_folders
    >>> for f in accelerate_folders("out/checkpoints") or []:  # doctest: +SKIP
    ...     print(f.name, f.state, f.step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.accelerate._choose import _ACCELERATE_FILES, _automatic_folders, _url, folder_manifest
from lightning_async_ckpt.accelerate._layout import INCOMPLETE_MARKER
from lightning_async_ckpt.errors import ManifestError, StoreUnavailableError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from lightning_async_ckpt.storage.regular import url_to_regular_fs

__all__ = ["AccelerateFolder", "accelerate_folders", "verify_accelerate_folder"]

_MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class AccelerateFolder:
    """One folder written by ``accelerator.save_state``.

    Attributes:
        name: The folder's name (``checkpoint_3``, or the ``output_dir``'s own name).
        url: Its location, as a URL of its filesystem (a plain path for local folders).
        state: ``"committed"`` (a valid manifest, and every object it lists is there with its size),
            ``"uncommitted"`` (an asynchronous save that never finished), ``"invalid"`` (a manifest that does not
            parse, or objects missing or resized: e.g. a deletion that stopped halfway) or ``"foreign"``
            (accelerate's files and no manifest: not written through this library, or by a save that died before
            it marked the folder).
        step: The step its manifest records; ``None`` without a valid manifest.
        index: ``N`` of an automatically named ``checkpoint_N`` folder, else ``None``.
        manifest: The parsed manifest when committed.
        error: Why the manifest was rejected (``state == "invalid"``).
        mtime: The folder's modification time when the filesystem reports one, else the manifest's ``committed_at``
            (the writer's clock); shown as an age, never used to choose a folder (they rank by ``N``).
    """

    name: str
    url: str
    state: str
    step: int | None = None
    index: int | None = None
    manifest: Manifest | None = None
    error: str | None = None
    mtime: float | None = None

    @property
    def committed(self) -> bool:
        """Whether the folder holds a valid manifest (it may still be damaged: see :func:`verify_accelerate_folder`)."""
        return self.state == "committed"


def accelerate_folders(uri: str, storage_options: dict[str, Any] | None = None) -> list[AccelerateFolder] | None:
    """The accelerate checkpoint folders at ``uri``, or ``None`` when ``uri`` is not an accelerate layout.

    ``uri`` is either one folder passed to ``save_state`` (it holds ``manifest.json``, the in-progress marker or
    accelerate's files) or the folder holding ``checkpoint_N`` folders (``<project_dir>/checkpoints``). The
    automatic folders are listed by ``N``.

    Args:
        uri: A local path or fsspec URL.
        storage_options: fsspec options for ``uri`` (endpoint, credentials).

    Raises:
        StoreUnavailableError: ``uri`` exists but cannot be listed.
    """
    fs, root = url_to_regular_fs(uri, **(storage_options or {}))
    root = root.rstrip("/") or root
    try:
        if not fs.isdir(root):
            return None
        single = any(fs.exists(f"{root}/{n}") for n in (MANIFEST_NAME, INCOMPLETE_MARKER, *_ACCELERATE_FILES))
        if single:
            return [_read_folder(fs, root, None)]
        autos = _automatic_folders(fs, root)
    except Exception as exc:  # noqa: BLE001 - any listing failure is reported, never read as "not a layout"
        raise StoreUnavailableError(f"could not list {uri!r}: {type(exc).__name__}: {exc}") from exc
    if not autos:
        return None
    return [_read_folder(fs, folder, index) for index, folder in sorted(autos)]


def verify_accelerate_folder(folder: AccelerateFolder, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Re-read every object a committed folder's manifest lists; return one line per problem (empty when intact).

    Args:
        folder: A folder from :func:`accelerate_folders`.
        storage_options: fsspec options for its location.
    """
    if folder.state != "committed":
        return [f"{folder.name}: not committed ({folder.error or folder.state})"]
    fs, path = url_to_regular_fs(folder.url, **(storage_options or {}))
    try:
        folder_manifest(fs, path, verify=True)
    except ManifestError as exc:
        detail = str(exc).split(": ", 1)[-1]
        return [p.strip() for p in detail.split("; ") if p.strip()]
    except FileNotFoundError:
        return [f"{folder.name}: its manifest disappeared while verifying"]
    return []


def _read_folder(fs: Any, path: str, index: int | None) -> AccelerateFolder:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    url = _url(fs, path)
    where = f"{path}/{MANIFEST_NAME}"
    try:
        size = fs.info(where).get("size") or 0
    except FileNotFoundError:
        state = "uncommitted" if fs.exists(f"{path}/{INCOMPLETE_MARKER}") else "foreign"
        return AccelerateFolder(name=name, url=url, state=state, index=index, mtime=_mtime(fs, path))
    try:
        if size > _MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where} is {size} bytes, over the {_MAX_MANIFEST_BYTES}-byte cap")
        manifest = Manifest.from_json(fs.cat_file(where), where=where)
    except ManifestError as exc:
        return AccelerateFolder(
            name=name, url=url, state="invalid", index=index, error=str(exc), mtime=_mtime(fs, path)
        )
    try:
        folder_manifest(fs, path)  # every object there with its size: "committed" is never a folder half deleted
    except (ManifestError, FileNotFoundError) as exc:
        error = f"the manifest is valid but the folder does not match it: {' '.join(str(exc).split())}"
        return AccelerateFolder(
            name=name, url=url, state="invalid", step=manifest.step, index=index, error=error, mtime=_mtime(fs, path)
        )
    return AccelerateFolder(
        name=name,
        url=url,
        state="committed",
        step=manifest.step,
        index=index,
        manifest=manifest,
        mtime=_mtime(fs, path) or manifest.committed_at,  # the storage's clock first: committed_at is the writer's
    )


def _mtime(fs: Any, path: str) -> float | None:
    try:
        value = fs.info(path).get("mtime")
    except OSError:
        return None
    return float(value) if isinstance(value, (int, float)) else None
