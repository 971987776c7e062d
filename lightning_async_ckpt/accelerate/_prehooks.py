"""accelerate's save-state pre-hooks, run by the library's own :func:`~lightning_async_ckpt.accelerate.save_state`.

They are called as ``accelerator.save_state`` calls them, on every process. ``output_dir`` is a private local folder:
what they write there on the main process becomes objects of the generation (listed in its manifest, uploaded with
it); the folder is removed once the save has ended. Other processes' files are not kept.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from lightning_async_ckpt.errors import ConfigError, ManifestError
from lightning_async_ckpt.storage.manifest import validate_object_name

__all__ = ["remove_when_done", "run_save_pre_hooks"]


def run_save_pre_hooks(
    accelerator: Any, weights: list[dict], is_own: Callable[[Any], bool], *, keep: bool
) -> tuple[dict[str, tuple[str, Any]], str | None]:
    """Call the registered save-state pre-hooks as ``accelerator.save_state`` does; collect what they wrote.

    Args:
        accelerator: The ``Accelerator``.
        weights: The models' state dicts, in ``accelerator._models`` order (hooks may remove entries).
        is_own: Whether a hook is the checkpointer's own hook-path hook (not called here).
        keep: Collect the files (main process); otherwise they are removed at once.

    Returns:
        ``{object name: ("file", path)}`` for every file the hooks wrote, and the folder to remove once the save
        has ended (``None`` when there is nothing to remove).

    Raises:
        ConfigError: A hook wrote a file whose name cannot be an object name (e.g. ``..`` or a manifest).
    """
    hooks = [h for h in accelerator._save_model_state_pre_hook.values() if not is_own(h)]
    if not hooks:
        return {}, None
    folder = tempfile.mkdtemp(prefix="lightning_async_ckpt-save-hooks-")
    try:
        for hook in hooks:
            hook(accelerator._models, weights, folder)
        files = _files(folder) if keep else {}
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if not files:
        shutil.rmtree(folder, ignore_errors=True)
        return {}, None
    return files, folder


def _files(folder: str) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            try:
                validate_object_name(rel)
            except ManifestError as exc:
                raise ConfigError(
                    f"a save_state pre-hook wrote {rel!r} into output_dir, which cannot be stored as part of the "
                    f"checkpoint ({exc}); write it under another name"
                ) from exc
            out[rel] = ("file", path)
    return out


def remove_when_done(folder: str | None, handle: Any) -> None:
    """Remove the hooks' folder once ``handle``'s save has ended (at once without a save)."""
    if folder is None:
        return
    if handle is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        handle.committed.add_done_callback(lambda _: shutil.rmtree(folder, ignore_errors=True))
