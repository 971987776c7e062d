"""Restoring: :func:`load_state`, choosing the generation, and downloading remote generations."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from lightning_async_ckpt.accelerate._layout import _ATTR, _RNG_FILE_RE
from lightning_async_ckpt.errors import CheckpointError, ManifestError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from lightning_async_ckpt.storage.store import CheckpointStore, _Checksum


def load_state(
    accelerator: Any,
    uri: str,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    **load_kwargs: Any,
) -> Manifest | None:
    """Restore the newest committed generation under ``uri`` (or ``step``) with ``accelerator.load_state``.

    ``uri`` is a store root (generations ``step-XXXXXXXX``) or one committed folder (a hook-path ``output_dir``
    holding ``manifest.json``). Uncommitted generations are never loaded. Local generations are loaded in place;
    others are downloaded to a temporary folder (checksums verified) first. Collective: every process must call
    it; the main process chooses the generation. ``uri`` must be readable by every process.

    Args:
        accelerator: The ``Accelerator``.
        uri: Local folder or fsspec URL.
        step: A specific committed step; default the newest whose objects are all present with their sizes.
        storage_options: fsspec options for ``uri``.
        **load_kwargs: Passed to ``accelerator.load_state``.

    Returns:
        The restored generation's manifest, or ``None`` if ``uri`` holds no committed generation.

    Raises:
        ManifestError: ``step`` is not a committed generation, or an object does not match its manifest.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    root = root.rstrip("/") or "/"
    single = fs.exists(f"{root}/{MANIFEST_NAME}")
    store = None if single else CheckpointStore(uri, storage_options, check_writable=False)
    choice: int | None = None
    error: BaseException | None = None
    if accelerator.is_main_process:
        try:
            choice = _choose(fs, root, store, step)
        except Exception as exc:  # noqa: BLE001 - raised on every process below
            error = exc
    choice = _together(accelerator, error, choice)  # every process loads the main process's choice
    if choice is None:
        return None
    error, tmp, folder = None, None, root
    try:
        if store is None:
            manifest = _folder_manifest(fs, root)
            urls = {o.name: f"{root}/{o.name}" for o in manifest.objects}
        else:
            manifest = store.manifest(choice)
            urls = {o.name: url for o, url in store.iter_objects(choice)}
            folder = store.url(choice)
        if not isinstance(fs, LocalFileSystem):
            tmp = folder = tempfile.mkdtemp(prefix="lightning_async_ckpt-load-")
            _download(fs, manifest, urls, tmp, accelerator.process_index)
    except Exception as exc:  # noqa: BLE001 - raised on every process below
        error = exc
    try:
        _together(accelerator, error)
        accelerator.load_state(folder, **load_kwargs)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    checkpointer = getattr(accelerator, _ATTR, None)
    if checkpointer is not None and not checkpointer.closed:
        checkpointer.step = manifest.step
    return manifest


def _choose(fs: Any, root: str, store: CheckpointStore | None, step: int | None) -> int | None:
    if store is None:
        manifest = _folder_manifest(fs, root)
        if step is not None and manifest.step != step:
            raise ManifestError(f"{root} holds step {manifest.step}, not {step}")
        return manifest.step
    if step is None:
        info = store.latest()
        return None if info is None else info.step
    problems = store.check_sizes(store.manifest(step))
    if problems:
        raise ManifestError(f"generation step {step} under {store.uri} is damaged: {'; '.join(problems)}")
    return step


def _folder_manifest(fs: Any, folder: str) -> Manifest:
    where = f"{folder}/{MANIFEST_NAME}"
    manifest = Manifest.from_json(fs.cat_file(where), where=where)
    problems = []
    for obj in manifest.objects:
        try:
            size = fs.info(f"{folder}/{obj.name}").get("size")
        except FileNotFoundError:
            problems.append(f"{obj.name}: missing")
            continue
        if size != obj.size:
            problems.append(f"{obj.name}: size {size}, manifest says {obj.size}")
    if problems:
        raise ManifestError(f"{folder} does not match its manifest: {'; '.join(problems)}")
    return manifest


def _together(accelerator: Any, error: BaseException | None, payload: Any = None) -> Any:
    """Collective: raise the same failure on every process; return the main process's payload."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        message = None if error is None else f"{type(error).__name__}: {error}"
        gathered = gather_object([(message, payload)])
        failed = [(rank, m) for rank, (m, _) in enumerate(gathered) if m]
        if error is None and failed:
            raise CheckpointError(f"load_state failed on process {failed[0][0]}: {failed[0][1]}")
        payload = gathered[0][1]
    if error is not None:
        raise error
    return payload


def _download(fs: Any, manifest: Manifest, urls: dict[str, str], dest: str, rank: int) -> None:
    for obj in manifest.objects:
        match = _RNG_FILE_RE.match(obj.name)
        if match and int(match.group(1)) != rank:
            continue  # another process's RNG state
        path = os.path.join(dest, *obj.name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        digest, size = _Checksum(obj.checksum.split(":", 1)[0]), 0
        with fs.open(urls[obj.name], "rb") as src, open(path, "wb") as out:
            while chunk := src.read(8 << 20):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        if size != obj.size or digest.hexdigest() != obj.checksum:
            raise ManifestError(f"{urls[obj.name]} does not match its manifest (size {size}, expected {obj.size})")
