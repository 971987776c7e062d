"""Sharded data files spread over hashed key prefixes (``CheckpointStore(hashed_prefixes=True)``).

Every rank's DCP data file goes to ``<root>/spread/<h>/step-N/``, recorded in the manifest (``root_path``); readers
(``latest``, ``verify``, ``open``, DCP's loader, the commit's and retention's listing checks) follow the manifest,
and retention removes the spread objects with their generation. Each test failed before the option existed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_async_ckpt.errors import ManifestError
from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 64), "b": torch.randn(64), "n": torch.arange(10)}


def _spread_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "spread").rglob("*") if p.is_file())


def _save(store: CheckpointStore, steps: list[int], keep_last: int | None = None) -> dict[int, dict[str, Any]]:
    states = {}
    with ShardedCheckpointer(store, keep_last=keep_last) as ckpt:
        for step in steps:
            states[step] = _state(step)
            ckpt.save(step, {k: v.clone() for k, v in states[step].items()}).result(timeout=60)
    return states


def test_data_files_are_spread_recorded_and_read_back(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), hashed_prefixes=True)
    states = _save(store, [1])
    manifest = store.manifest(1)
    data = [o for o in manifest.objects if o.name.endswith(".distcp")]
    assert data and all(o.root_path and o.root_path.startswith("spread/") for o in data)
    assert "/step-00000001/" in data[0].root_path
    folder = tmp_path / "step-00000001"
    assert not [p.name for p in folder.iterdir() if ".distcp" in p.name]  # nothing of the data in the folder
    assert _spread_files(tmp_path) == sorted(o.root_path for o in data)
    assert store.latest().step == 1 and store.verify(1).ok
    with store.open(1, data[0].name) as f:
        assert len(f.read()) == data[0].size
    assert store.object_url(1, data[0].name) == str(tmp_path / data[0].root_path)
    loaded = {k: torch.zeros_like(v) for k, v in states[1].items()}
    dcp.load(loaded, checkpoint_id=store.latest().dcp_path)  # DCP's own reader follows .metadata's paths
    assert all(torch.equal(loaded[k], states[1][k]) for k in loaded)


def test_load_generation_verifies_what_it_reads(tmp_path: Path) -> None:
    from lightning_async_ckpt.sharded.spread import load_generation

    store = CheckpointStore(str(tmp_path), hashed_prefixes=True)
    states = _save(store, [1])
    loaded = {k: torch.zeros_like(v) for k, v in states[1].items()}
    assert load_generation(loaded, store, 1) == ["__0_0.distcp"]
    assert all(torch.equal(loaded[k], states[1][k]) for k in loaded)
    victim = next(o for o in store.manifest(1).objects if o.root_path)
    (tmp_path / victim.root_path).write_bytes(b"x" * victim.size)  # same size, other bytes
    with pytest.raises(ManifestError, match="failed verification at load"):
        load_generation({k: torch.zeros_like(v) for k, v in states[1].items()}, store, 1)


def test_a_damaged_spread_object_is_found_by_verify_and_latest(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), hashed_prefixes=True)
    _save(store, [1, 2])
    spread = store.manifest(2).objects
    victim = next(o for o in spread if o.root_path)
    (tmp_path / victim.root_path).write_bytes(b"x" * victim.size)  # same size, other bytes
    assert not store.verify(2).ok
    with pytest.warns(UserWarning, match="step-00000002"):
        assert store.latest().step == 1
    (tmp_path / victim.root_path).unlink()
    assert store.check_sizes(store.manifest(2)) == [f"{victim.name}: missing"]


def test_retention_removes_the_spread_objects_of_what_it_removes(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), hashed_prefixes=True)
    _save(store, [1, 2, 3], keep_last=2)
    assert [g.step for g in store.generations()] == [2, 3]
    kept = sorted(o.root_path for step in (2, 3) for o in store.manifest(step).objects if o.root_path)
    assert _spread_files(tmp_path) == kept  # step 1's spread data went with its generation


def test_a_failed_attempt_s_spread_files_go_with_its_leftover(tmp_path: Path) -> None:
    from lightning_async_ckpt.sharded import ShardedSaveError
    from lightning_async_ckpt.testing import Fault

    faults = [Fault(op="open", path="/.metadata", at=2, times=1, error="oserror")]  # step 1's .metadata publish
    store = CheckpointStore(f"faulty://{tmp_path}", {"target_protocol": "file", "faults": faults}, hashed_prefixes=True)
    with ShardedCheckpointer(store, keep_last=1) as ckpt:
        ckpt.save(1, _state(1))
        with pytest.raises(ShardedSaveError):
            ckpt.drain(timeout=60)
        assert [p for p in _spread_files(tmp_path) if "/step-00000001/" in p]  # the failed attempt's data
        ckpt.save(2, _state(2)).result(timeout=60)  # its retention removes step 1's leftover, spread files too
    reader = CheckpointStore(str(tmp_path))
    assert [g.step for g in reader.generations(include_uncommitted=True)] == [2]
    assert _spread_files(tmp_path) == sorted(o.root_path for o in reader.manifest(2).objects if o.root_path)


def test_a_manifest_cannot_point_outside_its_own_spread_folder(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), hashed_prefixes=True)
    _save(store, [1])
    body = json.loads((tmp_path / "step-00000001" / MANIFEST_NAME).read_bytes())
    for bad in ("step-00000002/checkpoint.ckpt", "spread/0/step-00000002/x", "spread/zz/step-00000001/x", "../x"):
        body["objects"][0]["root_path"] = bad
        with pytest.raises(ManifestError, match="root_path"):
            Manifest.from_json(json.dumps(body).encode(), where="test")


def test_without_the_option_nothing_is_spread(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    _save(store, [1])
    assert not (tmp_path / "spread").exists()
    assert all(o.root_path is None for o in store.manifest(1).objects)
    assert b"root_path" not in (tmp_path / "step-00000001" / MANIFEST_NAME).read_bytes()


def test_on_s3_spread_objects_are_written_verified_loaded_and_collected(s3_uri: tuple[str, dict[str, Any]]) -> None:
    pytest.importorskip("s3fs")
    from lightning_async_ckpt.sharded.spread import load_generation

    uri, options = s3_uri
    store = CheckpointStore(uri, options, hashed_prefixes=True)
    states = _save(store, [1, 2], keep_last=1)
    reader = CheckpointStore(uri, options, check_writable=False)
    assert [g.step for g in reader.generations()] == [2] and reader.verify(2).ok
    keys = sorted(k.split("/ckpt/", 1)[1] for k in reader.fs.find(reader.root) if "/spread/" in k)
    assert keys == sorted(o.root_path for o in reader.manifest(2).objects if o.root_path)
    loaded = {k: torch.zeros_like(v) for k, v in states[2].items()}
    load_generation(loaded, reader, 2)
    assert all(torch.equal(loaded[k], states[2][k]) for k in loaded)


@pytest.mark.slow
def test_two_gloo_ranks_spread_their_data_files_and_load_them_back(tmp_path: Path) -> None:
    import sys

    from tests.helpers.dist import launch_ranks

    worker = Path(__file__).resolve().parents[1] / "helpers" / "spread_worker.py"
    results = []
    for proc in launch_ranks([sys.executable, str(worker), str(tmp_path)], timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][7:]))
    rank0, rank1 = sorted(results, key=lambda r: r["rank"])
    assert rank0["step"] == rank1["step"] == 2 and rank0["equal"] and rank1["equal"]
    assert rank0["steps"] == [2] and rank0["store_verified"]  # keep_last=1 removed step 1, its spread files too
    # Each rank verified at load only the object its shards are in (not the whole generation).
    assert rank0["verified"] == ["__0_0.distcp"] and rank1["verified"] == ["__1_0.distcp"]
    assert len(rank0["root_paths"]) == 2 and all("/step-00000002/__" in p for p in rank0["root_paths"])
    assert rank0["spread_files"] == rank0["root_paths"]


def test_an_open_upload_under_a_committed_generation_s_spread_prefix_is_aborted(
    s3_uri: tuple[str, dict[str, Any]],
) -> None:
    pytest.importorskip("s3fs")
    import s3fs

    uri, options = s3_uri
    store = CheckpointStore(uri, options, hashed_prefixes=True)
    _save(store, [1])
    spread = next(o.root_path for o in store.manifest(1).objects if o.root_path)
    key = f"{store.root}/{spread.rsplit('/', 1)[0]}/__9_0.distcp.deadbeef"  # a zombie attempt's upload, left open
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    zombie = fs.open(key, "wb", block_size=5 << 20)
    zombie.write(b"x" * (6 << 20))
    zombie.flush()  # the first part is uploaded: a multipart upload is open
    report = store.upload_sweeper.sweep(store.location)
    aborted = [u.key for u in report.aborted]
    assert aborted == [key.split("/", 1)[1]]  # committed step 1: no live attempt can still finish it
    assert not fs.call_s3("list_multipart_uploads", Bucket=store.root.split("/", 1)[0]).get("Uploads")
    zombie.closed = True  # its upload is gone: the zombie must not try to complete it when collected
