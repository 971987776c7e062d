"""Issue 43, point 3: ``lightning-async-ckpt export STORE STEP --format safetensors``."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from torch import nn

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.tools.cli import main


def _store(tmp_path) -> tuple[str, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    uri = str(tmp_path / "run")
    with AsyncCheckpointer(CheckpointStore(uri)) as ckpt:
        ckpt.save(3, {"model": model.state_dict()})
        ckpt.save(6, {"model": model.state_dict()})
    return uri, model


def test_export_latest_with_shards_loads_with_safetensors(tmp_path, capsys):
    uri, model = _store(tmp_path)
    out = str(tmp_path / "hub")
    args = ["export", uri, "latest", "--format", "safetensors", "--out", out, "--dtype", "float16"]
    assert main([*args, "--max-shard-size", "1KiB", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["step"] == 6 and "model.safetensors.index.json" in body["files"]
    store = CheckpointStore(out, check_writable=False)
    assert store.verify(6).ok
    folder = store.generation_path(6)
    index = json.loads(open(f"{folder}/model.safetensors.index.json").read())  # noqa: SIM115
    merged = {}
    for name in set(index["weight_map"].values()):
        merged.update(load_file(f"{folder}/{store.manifest(6).object(name).key}"))
    assert merged.keys() == model.state_dict().keys()
    assert all(torch.equal(merged[k], v.half()) for k, v in model.state_dict().items())


def test_export_default_location_and_bad_input(tmp_path, capsys):
    uri, _ = _store(tmp_path)
    assert main(["export", uri, "3", "--format", "safetensors"]) == 0
    assert "exported step 3" in capsys.readouterr().out
    assert [g.step for g in CheckpointStore(f"{uri}/exports/safetensors", check_writable=False).generations()] == [3]
    assert main(["export", uri, "4", "--format", "safetensors"]) == 2  # not committed
    assert "step 4" in capsys.readouterr().err
    assert main(["export", uri, "three", "--format", "safetensors"]) == 2
    assert "STEP must be" in capsys.readouterr().err
    assert main(["export", uri, "3", "--format", "onnx"]) == 2
    # The source store's own commands are unaffected by the exports folder inside it.
    assert main(["verify", uri]) == 0
    assert "2 ok, 0 failed" in capsys.readouterr().out
