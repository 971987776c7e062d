"""Which generation :func:`~lightning_async_ckpt.accelerate.load_state` restores (the main process decides).

Recognised under ``uri``: one committed folder, a folder of ``checkpoint_N`` folders (the newest intact committed
one) or a store root of ``step-XXXXXXXX`` generations. An uncommitted or manifest-less folder is an error, never a
silent ``None``; ``None`` means the location holds no committed generation.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.accelerate._layout import INCOMPLETE_MARKER
from lightning_async_ckpt.errors import CheckpointError, ManifestError
from lightning_async_ckpt.storage.finder import RELISTS
from lightning_async_ckpt.storage.generation import subfolders_holding_checkpoints
from lightning_async_ckpt.storage.io import Discard, read_verified
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

_log = logging.getLogger("lightning_async_ckpt")
_AUTO_RE = re.compile(r"^checkpoint_(\d+)$")
# Files accelerate's save_state always writes; a folder with one of them and no manifest is a foreign save.
_ACCELERATE_FILES = ("model.safetensors", "pytorch_model.bin", "optimizer.bin", "random_states_0.pkl")


@dataclass(frozen=True)
class Choice:
    """The generation every process loads: its folder's URL and its step (picklable, sent to every process); with
    ``manifest`` when the folder's own is still being written (a copy restored from a peer, committed in the
    background: :mod:`~lightning_async_ckpt.tiers.replica_persist`)."""

    url: str
    step: int
    manifest: Any = None


def choose(fs: Any, root: str, uri: str, options: dict[str, Any], step: int | None) -> Choice | None:
    """The generation to load under ``root``, or ``None`` when a store holds no committed generation yet.

    Raises:
        CheckpointError: ``root`` is an uncommitted save or a folder of accelerate files without a manifest.
        ManifestError: ``step`` is not a committed generation there, or the chosen one is damaged.
    """
    if fs.exists(f"{root}/{MANIFEST_NAME}"):
        manifest = folder_manifest(fs, root, verify=True)
        if step is not None and manifest.step != step:
            raise ManifestError(f"{root} holds step {manifest.step}, not {step}")
        return Choice(url=_url(fs, root), step=manifest.step)
    if fs.exists(f"{root}/{INCOMPLETE_MARKER}"):
        raise CheckpointError(
            f"{uri} is an uncommitted asynchronous save (its manifest was never written, e.g. the process died "
            "before the save finished): some of its files may be missing or partial; load an older checkpoint"
        )
    autos = _automatic_folders(fs, root)
    if autos:
        return _choose_automatic(fs, root, autos, step)
    if any(fs.exists(f"{root}/{name}") for name in _ACCELERATE_FILES):
        raise CheckpointError(
            f"{uri} holds accelerate files but no {MANIFEST_NAME}: it was not written through lightning_async_ckpt "
            "(or its save never finished), so nothing proves it complete; load it with accelerator.load_state "
            "if you know it is"
        )
    store = CheckpointStore(uri, options, check_writable=False)
    if step is None:
        info = store.latest()  # checksums verified; damaged or uncommitted generations are skipped with a warning
        committed = store.generations() if info is None else []
        if committed:
            info = store.latest()  # committed since the first look (a save that was in flight): not damage
        if info is None:
            damaged = [g.step for g in committed]
            if damaged:
                raise CheckpointError(
                    f"no intact committed generation under {uri}: steps {damaged} are committed but damaged (see "
                    "the warnings); nothing was loaded. Check them with `lightning-async-ckpt verify`, or pass step="
                )
            nested = [] if store.generations(include_uncommitted=True) else subfolders_holding_checkpoints(fs, root)
            if nested:
                raise CheckpointError(
                    f"no checkpoint directly under {uri}, but these subfolders hold some: {', '.join(nested[:5])}; "
                    f"pass the one the run saved to (e.g. uri={uri.rstrip('/')}/{nested[0]}); nothing was loaded"
                )
            return None
        return Choice(url=store.url(info.step), step=info.step)
    problems = store.check_sizes(store.manifest(step))
    if problems:
        raise ManifestError(f"generation step {step} under {store.uri} is damaged: {'; '.join(problems)}")
    return Choice(url=store.url(step), step=step)


def folder_manifest(fs: Any, folder: str, *, verify: bool = False) -> Manifest:
    """The manifest of one committed folder, after checking every object it lists is there with its size.

    Args:
        fs: The folder's filesystem.
        folder: The folder's path on ``fs``.
        verify: Also re-read every object and check its checksum.

    Raises:
        FileNotFoundError: The folder has no manifest (not committed).
        ManifestError: The manifest is invalid, or an object is missing, has another size or (with ``verify``)
            another checksum.
    """
    where = f"{folder}/{MANIFEST_NAME}"
    manifest = Manifest.from_json(fs.cat_file(where), where=where)
    problems = []
    for obj in manifest.objects:
        try:
            size = fs.info(f"{folder}/{obj.key}").get("size")
        except FileNotFoundError:
            problems.append(f"{obj.name}: missing")
            continue
        if size != obj.size:
            problems.append(f"{obj.name}: size {size}, manifest says {obj.size}")
        elif verify:
            try:
                read_verified(fs, f"{folder}/{obj.key}", obj, into=Discard())
            except ManifestError as exc:
                problems.append(f"{obj.name}: {' '.join(str(exc).split())}")
    if problems:
        raise ManifestError(f"{folder} does not match its manifest: {'; '.join(problems)}")
    return manifest


def _automatic_folders(fs: Any, root: str) -> list[tuple[int, str]]:
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        match = _AUTO_RE.match(name)
        if match and entry.get("type") == "directory":
            found.append((int(match.group(1)), f"{root}/{name}"))
    return sorted(found, reverse=True)


def _choose_automatic(fs: Any, root: str, autos: list[tuple[int, str]], step: int | None) -> Choice | None:
    """The newest committed intact ``checkpoint_N`` (or the one holding ``step``).

    A folder removed while it is read (accelerate's ``total_limit`` retention after a newer save) is neither
    skipped as uncommitted nor counted as damaged: the folders are listed again (bounded by ``RELISTS``), so
    "nothing to load" is said only of a listing whose folders all stayed while they were read.
    """
    for _ in range(RELISTS):
        skipped: list[str] = []
        damaged = 0
        vanished = False
        for _, folder in autos:
            try:
                manifest = folder_manifest(fs, folder, verify=step is None or _folder_step(fs, folder) == step)
            except (FileNotFoundError, ManifestError) as exc:
                if _gone(fs, folder, exc):
                    vanished = True
                    continue
                if step is None:
                    why = _why(fs, folder, exc)
                    damaged += not why.endswith("no manifest")
                    skipped.append(f"{folder.rsplit('/', 1)[-1]} ({why})")
                continue
            if step is not None and manifest.step != step:
                continue
            if skipped:
                _log.warning(
                    "load_state: skipping newer checkpoint folder(s) that are not committed: %s; loading %s (step %d)",
                    ", ".join(skipped),
                    folder,
                    manifest.step,
                )
            return Choice(url=_url(fs, folder), step=manifest.step)
        if not vanished:
            break
        autos = _automatic_folders(fs, root)
    else:
        raise CheckpointError(f"checkpoint folders under {root} kept vanishing while they were read; try again")
    if step is not None:
        raise ManifestError(f"no committed checkpoint_N folder under {root} holds step {step}")
    if damaged:
        raise CheckpointError(f"no intact committed checkpoint under {root}: {', '.join(skipped)}; nothing was loaded")
    if skipped:
        _log.warning("load_state: no checkpoint_N folder under %s is committed: %s", root, ", ".join(skipped))
    return None


def _gone(fs: Any, folder: str, exc: BaseException) -> bool:
    """Whether a folder that failed to read was removed meanwhile (gone, or its manifest gone after it was read)."""
    try:
        if not fs.exists(folder):
            return True
        return isinstance(exc, ManifestError) and not fs.exists(f"{folder}/{MANIFEST_NAME}")
    except Exception:  # noqa: BLE001 - cannot tell: judged as it was read
        return False


def _folder_step(fs: Any, folder: str) -> int | None:
    try:
        where = f"{folder}/{MANIFEST_NAME}"
        return Manifest.from_json(fs.cat_file(where), where=where).step
    except Exception:  # noqa: BLE001 - an unreadable manifest is reported by folder_manifest
        return None


def _why(fs: Any, folder: str, exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError) or not fs.exists(f"{folder}/{MANIFEST_NAME}"):
        return "uncommitted: no manifest" if fs.exists(f"{folder}/{INCOMPLETE_MARKER}") else "no manifest"
    return " ".join(str(exc).split())


def _url(fs: Any, path: str) -> str:
    from fsspec.implementations.local import LocalFileSystem

    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
