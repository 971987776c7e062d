"""Hook-path folders (fixed names, accelerate's layout) are written once: a stalled earlier save never lands in a
later save's committed files, and never replaces its manifest.

The folder writer is driven directly (two saves into one ``output_dir``, the first one stalled in the middle of
its object by the test's own ordering, no sleeps): accelerate's names are fixed, so the later save unlinks and
recreates them; the stalled save's descriptor then writes to an orphaned inode.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_async_ckpt.accelerate._folder import _FolderSave, _FolderStore
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.io import Checksum
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest

NAME = "lightning_async_ckpt_state.pt"


def _save(store: _FolderStore, folder: Path, step: int) -> _FolderSave:
    save = _FolderSave(folder=str(folder), step=step, expected=set())
    save.settle()  # nothing of accelerate's to wait for
    store.saves[step] = save
    return save


def test_a_stalled_folder_save_never_lands_in_the_next_saves_commit(tmp_path: Path) -> None:
    folder = tmp_path / "output_dir"
    store = _FolderStore("run")
    _save(store, folder, 1)
    zombie = store.begin(1)
    stream = zombie.open(NAME)
    stream.write(b"z" * 4096)  # the first save stalls here

    _save(store, folder, 2)
    writer = store.begin(2)
    data = os.urandom(1 << 20)
    writer.write_bytes(NAME, data)
    writer.commit()

    stream.write(b"Z" * (1 << 20))  # the stalled save wakes up and writes on through its old descriptor
    stream.close()
    with pytest.raises(CheckpointError):
        zombie.commit()
    zombie.abort()
    assert (folder / NAME).read_bytes() == data
    manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes())
    assert manifest.step == 2
    digest = Checksum(manifest.object(NAME).checksum.split(":")[0])
    digest.update(data)
    assert manifest.object(NAME).checksum == digest.hexdigest()
