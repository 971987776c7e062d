"""Generations that are folders: the hook path's ``output_dir`` and accelerate's automatically named ``checkpoint_N``."""

from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Any

from lightning_async_ckpt.accelerate._folder import _FolderSave, _FolderStore
from lightning_async_ckpt.accelerate._layout import INCOMPLETE_MARKER
from lightning_async_ckpt.accelerate._numbering import apply_total_limit, automatic_root, next_free_index
from lightning_async_ckpt.core.engine import AsyncCheckpointer, CheckpointOptions, SaveHandle
from lightning_async_ckpt.storage.io import fsync_dir
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME

__all__ = ["FolderSaves"]


class FolderSaves:
    """Writing generations into folders (hook path, automatic naming) and waiting for them before a load.

    Thread-safety: training thread, except the retention after a commit (upload thread), which takes
    ``_retention_lock``.
    """

    accelerator: Any
    options: CheckpointOptions
    run_id: str
    _folder_engine: AsyncCheckpointer | None
    _folder_store: _FolderStore | None
    _unsettled: list[_FolderSave]
    _retention_lock: Any

    def _quiesce(self, under: str | None) -> None:
        """Collective, before a load: confirm pending folders, finish staging, and let every hook-path save into
        ``under`` (a folder, or any folder below it) end, so loading sees it committed or failed."""
        self._settle_collectively()
        self.wait()
        error: BaseException | None = None
        for save in list(self._folder_store.saves.values()) if self._folder_store and under else []:
            inside = save.folder == under or save.folder.startswith(under.rstrip(os.sep) + os.sep)
            if inside and save.handle is not None:
                try:
                    save.handle.committed.result()
                except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
                    error = exc
        self._collective(error, doing=f"load_state({under!r}): waiting for saves into it")

    def _save_folder(self, folder: str, state: dict, step: int, expected: set[str] | None) -> SaveHandle:
        """Write ``state`` into ``folder`` as one generation; ``expected``: accelerate's files to wait for (hook
        path, committed once confirmed), or ``None`` when every file is ours (committed as soon as written)."""
        store, engine = self._get_folder_engine()
        # A save still in flight into this folder (or at this step) ends before the folder is rewritten.
        saves = list(store.saves.values())  # a snapshot: the upload thread removes saves as they end
        concurrent.futures.wait(
            [s.handle.committed for s in saves if s.handle and (s.folder == folder or s.step == step)]
        )
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, INCOMPLETE_MARKER), "wb") as f:
            f.write(json.dumps({"step": step, "run_id": self.run_id}).encode())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(os.path.join(folder, MANIFEST_NAME)):
            os.unlink(os.path.join(folder, MANIFEST_NAME))  # the folder is being rewritten: un-commit it first
        fsync_dir(folder)
        save = _FolderSave(folder=folder, step=step, expected=set(expected or ()))
        if expected is None:
            save.settle()  # nothing of accelerate's to wait for
        store.saves[step] = save
        try:
            save.handle = self._save(engine, step, state, extra={"layout": "accelerate", "output_dir": folder})
        except BaseException:
            store.saves.pop(step, None)
            raise
        save.handle.committed.add_done_callback(
            lambda _: store.saves.pop(save.step) if store.saves.get(save.step) is save else None
        )
        if expected is not None:
            self._unsettled.append(save)
        return save.handle

    def _save_automatic(self, step: int, state: dict) -> tuple[int, SaveHandle]:
        """Main process: ``state`` as accelerate's next ``checkpoint_N``; ``total_limit`` applied first, safely."""
        acc = self.accelerator
        root = automatic_root(acc)
        limit = acc.project_configuration.total_limit
        store, _ = self._get_folder_engine()

        def retain(upto: int | None) -> None:
            with self._retention_lock:  # the training thread before a save, the upload thread after a commit
                apply_total_limit(root, limit, {s.folder for s in list(store.saves.values())}, upto=upto)

        retain(None)
        index = max(acc.project_configuration.iteration, next_free_index(acc) or 0)
        folder = os.path.abspath(os.path.join(root, f"checkpoint_{index}"))
        handle = self._save_folder(folder, state, step, None)
        if limit is not None:
            handle.committed.add_done_callback(
                lambda fut: None if fut.cancelled() or fut.exception() else retain(index)
            )
        return index, handle

    def _get_folder_engine(self) -> tuple[_FolderStore, AsyncCheckpointer]:
        if self._folder_engine is None:
            # Skipping would leave a folder accelerate cannot load: the hook path waits (or aborts).
            admission = "abort" if self.options.admission == "abort" else "wait"
            opts = CheckpointOptions(**{**self.options.__dict__, "admission": admission, "keep_last": None})
            store = _FolderStore(self.run_id)
            self._folder_store, self._folder_engine = store, self._new_engine(store, opts)
        return self._folder_store, self._folder_engine  # type: ignore[return-value]
