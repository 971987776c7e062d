"""The default serializer: a ``torch.save`` stream without the zip's own CRC-32 (the library checksums every object)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.core.options import TorchSaveSerializer


def _state() -> dict:
    return {"w": torch.randn(64, 64), "nested": [1, {"b": torch.arange(7)}], "view": torch.randn(20)[3:9]}


def _save(tmp_path, serializer: TorchSaveSerializer | None = None) -> str:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    with AsyncCheckpointer(store, serializer=serializer) as ckpt:
        ckpt.save(1, _state()).committed.result(timeout=60)
    assert store.verify(1).ok
    return store.url(1, "checkpoint.ckpt")


@pytest.mark.parametrize("mmap", [False, True])
def test_the_default_object_loads_with_torch_load_including_mmap_and_weights_only(tmp_path, mmap):
    torch.manual_seed(0)
    expected = _state()
    torch.manual_seed(0)
    path = _save(tmp_path)
    loaded = torch.load(path, weights_only=True, mmap=mmap)
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["nested"][1]["b"], expected["nested"][1]["b"])
    assert torch.equal(loaded["view"], expected["view"])


def test_the_default_skips_the_zip_crc_and_zip_crc32_true_keeps_it(tmp_path):
    skipped = _save(tmp_path / "a")
    kept = _save(tmp_path / "b", TorchSaveSerializer(zip_crc32=True))
    with zipfile.ZipFile(skipped) as z:
        data = [i for i in z.infolist() if "/data/" in i.filename]
        assert data and all(i.CRC == 0 for i in data)
    with zipfile.ZipFile(kept) as z:
        assert z.testzip() is None  # every record's CRC matches


@pytest.mark.parametrize("user_setting", [True, False])
def test_the_process_wide_torch_crc_option_is_never_changed(tmp_path, user_setting):
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(user_setting)
    try:
        _save(tmp_path)
        assert torch.serialization.get_crc32_options() is user_setting
    finally:
        torch.serialization.set_crc32_options(before)


def test_a_replaced_torch_save_sees_every_save_like_model_checkpoint(tmp_path, monkeypatch):
    # Lightning's own tests (and users) count checkpoints by patching torch.save.
    calls = []
    original = torch.save

    def counting(obj, f, *args, **kwargs):
        calls.append(f)
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    path = _save(tmp_path)
    assert len(calls) == 1
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # torch.save as it is, its CRC included
