"""Accelerate's automatic checkpoint naming: ``<project_dir>/checkpoints/checkpoint_<iteration>``.

A restarted process starts again at ``iteration=0``: :func:`continue_numbering` moves it past every existing folder
(committed or not), so numbering never goes backwards and ``total_limit`` never deletes the newest folders.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

from lightning_async_ckpt.storage.io import fsync_dir
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME

__all__ = [
    "AUTO_FOLDER_RE",
    "apply_total_limit",
    "automatic_root",
    "continue_numbering",
    "next_free_index",
    "uncommitted_load_message",
]

_log = logging.getLogger("lightning_async_ckpt")
AUTO_FOLDER_RE = re.compile(r"^checkpoint_(\d+)$")


def automatic_root(accelerator: Any) -> str | None:
    """``<project_dir>/checkpoints`` with automatic checkpoint naming, else ``None``."""
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        return None
    return os.path.join(accelerator.project_dir, "checkpoints")


def next_free_index(accelerator: Any) -> int | None:
    """One past the highest ``checkpoint_N`` folder that exists (0 when none); ``None`` without automatic naming."""
    root = automatic_root(accelerator)
    if root is None:
        return None
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    found = [int(m.group(1)) for m in map(AUTO_FOLDER_RE.match, names) if m]
    return max(found) + 1 if found else 0


def uncommitted_load_message(folder: str) -> str:
    """What ``accelerator.load_state`` says when it was pointed at ``folder``, a save a kill left uncommitted
    (accelerate's own ``load_state()`` picks the highest ``checkpoint_N`` whether or not it committed)."""
    name = os.path.basename(folder)
    root = os.path.dirname(folder) if AUTO_FOLDER_RE.match(name) else folder
    committed = sorted(
        (int(m.group(1)), m.group(0))
        for m in map(AUTO_FOLDER_RE.match, os.listdir(root) if os.path.isdir(root) else [])
        if m and os.path.exists(os.path.join(root, m.group(0), MANIFEST_NAME))
    )
    newest = f"the newest committed one, {committed[-1][1]}" if committed else "the newest committed generation"
    return (
        f"{folder} is an uncommitted asynchronous save (its manifest was never written, e.g. the process was "
        "killed before it finished): accelerator.load_state cannot load it. Resume with the library's loader, which "
        f"loads {newest}, and continues accelerate's numbering past every folder there: replace "
        "accelerator.load_state(...) with\n"
        f"    from lightning_async_ckpt.accelerate import load_state\n    load_state(accelerator, {root!r})"
    )


def continue_numbering(accelerator: Any, next_index: int | None) -> None:
    """Move ``project_configuration.iteration`` up to ``next_index`` (never down); the same on every process."""
    project = accelerator.project_configuration
    if next_index is None or project.iteration >= next_index:
        return
    _log.info(
        "load_state: accelerate's next automatic checkpoint is checkpoint_%d (project_configuration.iteration was %d; "
        "checkpoint_0..checkpoint_%d exist or existed there)",
        next_index,
        project.iteration,
        next_index - 1,
    )
    project.iteration = next_index


def apply_total_limit(root: str, total_limit: int | None, in_flight: set[str], *, upto: int | None = None) -> list[str]:
    """Remove the oldest ``checkpoint_N`` folders as accelerate's ``total_limit`` does, but never a folder in
    ``in_flight`` (a background commit still needs it) nor the newest committed one (a newer save may still fail).
    A committed folder loses its manifest first, so a crash halfway through leaves an uncommitted folder, never a
    committed one with files missing.

    Args:
        root: ``<project_dir>/checkpoints``.
        total_limit: accelerate's ``ProjectConfiguration.total_limit`` (``None``: keep everything).
        in_flight: Absolute paths of folders this process is still writing.
        upto: After ``checkpoint_<upto>`` committed: count only folders up to it and keep ``total_limit``. Default:
            before a new save, make room for it (keep ``total_limit - 1``), as accelerate does.

    Returns:
        The folders removed.
    """
    if total_limit is None or not os.path.isdir(root):
        return []
    folders = sorted(
        (int(m.group(1)), os.path.abspath(os.path.join(root, name)))
        for name in os.listdir(root)
        if (m := AUTO_FOLDER_RE.match(name)) and os.path.isdir(os.path.join(root, name))
    )
    if upto is not None:
        folders = [(i, path) for i, path in folders if i <= upto]
    committed = [path for _, path in folders if os.path.exists(os.path.join(path, MANIFEST_NAME))]
    keep = set(in_flight) | set(committed[-1:])
    excess = len(folders) + (1 if upto is None else 0) - total_limit
    removed: list[str] = []
    for _, path in folders:
        if len(removed) >= excess:
            break
        if path in keep:
            continue
        try:
            os.unlink(os.path.join(path, MANIFEST_NAME))
            fsync_dir(path)
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        _log.info("total_limit=%d: removed %s", total_limit, ", ".join(os.path.basename(p) for p in removed))
    return removed
