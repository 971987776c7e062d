"""Issue 43, point 3: safetensors export of committed generations (single-stream and DCP), its own committed
generation, and the background exporter driven by commit callbacks."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lightning_async_ckpt import CheckpointStore, Committed
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.export import INDEX_NAME, SINGLE_NAME, export_location, export_safetensors
from lightning_async_ckpt.core.exporter import Exporter, ExportError, SafetensorsExport
from lightning_async_ckpt.errors import ConfigError, ManifestError, StorageError
from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.testing import Fault


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _saved(tmp_path, model: nn.Module, step: int = 4) -> str:
    uri = str(tmp_path / "run")
    with AsyncCheckpointer(CheckpointStore(uri)) as ckpt:
        ckpt.save(step, {"model": model.state_dict(), "optim": {"lr": 0.1}, "step": step})
    return uri


def _files(uri: str, step: int) -> dict:
    store = CheckpointStore(uri, check_writable=False)
    folder = store.generation_path(step)
    return {o.name: f"{folder}/{o.key}" for o in store.manifest(step).objects}


def test_a_single_stream_generation_exports_to_one_file_loadable_with_safetensors_alone(tmp_path):
    model = _model()
    uri = _saved(tmp_path, model)
    manifest = export_safetensors(uri, 4)
    exports = CheckpointStore(export_location(uri), check_writable=False)
    assert [g.step for g in exports.generations()] == [4] and exports.verify(4).ok  # committed, checksummed
    assert manifest.extra["format"] == "safetensors" and manifest.extra["exported_from"]["step"] == 4
    loaded = load_file(_files(export_location(uri), 4)[SINGLE_NAME])
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())  # the weights only, exact
    # The source store still lists only its own generations: the exports folder is a store of its own.
    assert [g.step for g in CheckpointStore(uri, check_writable=False).generations()] == [4]


def test_dtype_cast_and_shards_with_an_index_above_the_size(tmp_path):
    model = _model()
    uri = _saved(tmp_path, model)
    manifest = export_safetensors(uri, 4, str(tmp_path / "bf16"), dtype="bfloat16", max_shard_size=4096)
    files = _files(str(tmp_path / "bf16"), 4)
    index = json.loads(Path(files[INDEX_NAME]).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(shards) | {INDEX_NAME} == set(files) == set(manifest.extra["files"])
    merged = {}
    for name in shards:
        merged.update(load_file(files[name]))
    assert merged.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert merged[key].dtype == torch.bfloat16 and torch.equal(merged[key], value.to(torch.bfloat16))
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in merged.values())


def test_tied_weights_export(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=False))
    model[1].weight = model[0].weight  # shares storage: safetensors refuses shared tensors unless copied apart
    uri = _saved(tmp_path, model)
    export_safetensors(uri, 4)
    loaded = load_file(_files(export_location(uri), 4)[SINGLE_NAME])
    assert torch.equal(loaded["0.weight"], loaded["1.weight"])


def test_a_dcp_generation_is_consolidated_with_dcp_and_strip_prefix_renames(tmp_path):
    model = _model()
    uri = str(tmp_path / "dcp")
    with ShardedCheckpointer(uri) as ckpt:
        ckpt.save(2, {"model": model.state_dict(), "optim": {"lr": torch.tensor(0.1)}}).result(timeout=60)
    export_safetensors(uri, 2, strip_prefix="0.")
    loaded = load_file(_files(export_location(uri), 2)[SINGLE_NAME])
    assert torch.equal(loaded["weight"], model[0].weight) and torch.equal(loaded["2.bias"], model[2].bias)


def test_bad_arguments_name_the_parameter(tmp_path):
    uri = _saved(tmp_path, _model())
    with pytest.raises(ConfigError, match="dtype"):
        export_safetensors(uri, 4, dtype="int8")
    with pytest.raises(ConfigError, match="max_shard_size"):
        export_safetensors(uri, 4, max_shard_size=0)
    with pytest.raises(ConfigError, match="model_key='weights'"):
        export_safetensors(uri, 4, model_key="weights")
    with pytest.raises(ManifestError):
        export_safetensors(uri, 5)  # not committed
    with pytest.raises(ConfigError, match="every_n"):
        SafetensorsExport(every_n=0)
    assert not CheckpointStore(export_location(uri), check_writable=False).generations()


def test_a_failed_export_leaves_no_manifest_and_a_retry_commits(tmp_path):
    uri = _saved(tmp_path, _model())
    faulty = CheckpointStore(
        "faulty://" + str(tmp_path / "out"),
        {"target_protocol": "file", "faults": [Fault(op="write", path=SINGLE_NAME, at=1, error="enospc")]},
    )
    with pytest.raises(StorageError, match="No space left"):
        export_safetensors(uri, 4, faulty)
    out = CheckpointStore(str(tmp_path / "out"), check_writable=False)
    assert out.generations() == []  # never visible half-written
    export_safetensors(uri, 4, str(tmp_path / "out"))  # a new attempt, never the failed one's names
    assert [g.step for g in out.generations()] == [4] and out.verify(4).ok


def test_an_export_already_committed_is_kept_as_it_is(tmp_path):
    uri = _saved(tmp_path, _model())
    first = export_safetensors(uri, 4)
    again = export_safetensors(uri, 4, dtype="float16")
    assert again == first  # written once, never reopened


class _ThreadRecordingExporter(Exporter):
    """The real exporter, recording which thread wrote each export."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []

    def _export(self, committed: Committed):
        self.threads.append(threading.current_thread().name)
        return super()._export(committed)


def test_the_exporter_exports_every_nth_and_the_final_generation_off_the_training_thread(tmp_path):
    model = _model()
    uri = str(tmp_path / "run")
    exporter = _ThreadRecordingExporter(SafetensorsExport(every_n=2, dtype="float16"))
    with AsyncCheckpointer(CheckpointStore(uri)) as ckpt:
        ckpt.add_commit_callback(exporter)
        for step in (1, 2, 3):
            with torch.no_grad():
                model[0].bias.add_(1.0)
            ckpt.save(step, {"model": model.state_dict()}).committed.result()
            ckpt.poll()
    assert exporter.finish() is True
    exports = CheckpointStore(export_location(uri), check_writable=False)
    assert [g.step for g in exports.generations()] == [2, 3]  # every 2nd, and the final one
    assert exporter.threads and all(t.startswith("lightning_async_ckpt-export") for t in exporter.threads)
    final = load_file(_files(export_location(uri), 3)[SINGLE_NAME])
    assert final["0.bias"].dtype == torch.float16 and torch.equal(final["0.bias"], model[0].bias.half())


def test_an_exporter_failure_is_raised_once_at_finish(tmp_path):
    uri = _saved(tmp_path, _model())
    exporter = Exporter(SafetensorsExport(model_key="missing"))
    exporter.submit(next(c for c in [_committed(uri, 4)]))
    with pytest.raises(ExportError, match="model_key='missing'"):
        exporter.finish()
    assert exporter.finish() is True  # once


def _committed(uri: str, step: int) -> Committed:
    from lightning_async_ckpt.core.commit_hooks import summarize

    store = CheckpointStore(uri, check_writable=False)
    return summarize(store.manifest(step), store, tier="durable")


def test_a_generation_retention_removed_before_its_export_is_skipped_with_a_warning(tmp_path, caplog):
    uri = str(tmp_path / "run")
    with AsyncCheckpointer(CheckpointStore(uri), keep_last=1) as ckpt:
        ckpt.save(1, {"model": _model().state_dict()}).committed.result()
        first = _committed(uri, 1)
        ckpt.save(2, {"model": _model().state_dict()}).committed.result()
    assert [g.step for g in CheckpointStore(uri, check_writable=False).generations()] == [2]  # keep_last removed 1
    exporter = Exporter(SafetensorsExport(final=False))
    exporter.submit(first)
    with caplog.at_level("WARNING", logger="lightning_async_ckpt"):
        assert exporter.finish() is True
    assert "removed by retention" in caplog.text
    assert CheckpointStore(export_location(uri), check_writable=False).generations() == []
