"""Requests of a commit on a real S3 API (moto server, every request counted server side).

The commit checks its objects with one listing of the generation before and one after the manifest, not one HEAD
per object; retention checks each generation it keeps with one listing. So the HEADs of one save do not grow with
the number of objects it wrote, and the commit still refuses an object that vanished or changed size.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_async_ckpt.errors import StorageError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.s3_requests import s3_requests

Location = tuple[str, dict[str, Any]]


def _save(store: CheckpointStore, step: int, objects: int) -> None:
    writer = store.begin(step)
    for i in range(objects):
        writer.write_bytes(f"shard-{i:03d}.bin", bytes([i]) * 64)
    writer.commit()
    store.gc(2)


def _counts_of_a_later_save(uri: str, options: dict[str, Any], objects: int) -> dict[str, int]:
    store = CheckpointStore(uri, options, run_id="this-run")
    _save(store, 1, objects)
    _save(store, 2, objects)  # the first pass builds the ledger
    with s3_requests() as log:
        _save(store, 3, objects)
    assert [g.step for g in store.generations()] == [2, 3]
    return dict(log.counts())


def test_the_heads_of_one_save_do_not_grow_with_its_objects(s3_uri: Location) -> None:
    uri, options = s3_uri
    one = _counts_of_a_later_save(uri, options, 1)
    twenty = _counts_of_a_later_save(uri.replace("/ckpt", "/twenty"), options, 20)
    assert twenty.get("HEAD", 0) == one.get("HEAD", 0), (one, twenty)
    assert twenty.get("LIST", 0) == one.get("LIST", 0), (one, twenty)
    # Writing 19 more objects costs 19 more PUTs, and removing them 0 more requests (one batch delete).
    assert twenty["PUT"] - one["PUT"] == 19, (one, twenty)


def test_the_commit_lists_its_generation_once_before_and_once_after_the_manifest(s3_uri: Location) -> None:
    uri, options = s3_uri
    store = CheckpointStore(uri, options)
    writer = store.begin(1)
    for i in range(20):
        writer.write_bytes(f"shard-{i:03d}.bin", b"x" * 64)
    with s3_requests() as log:
        writer.commit()
    counts = log.counts()
    assert counts.get("HEAD", 0) == 0, log.requests
    # The claim is read (GET) to fence a taken-over attempt, the manifest PUT, a listing before and after, and the
    # claim removed (DELETE).
    assert counts["LIST"] == 2 and counts["PUT"] == 1, log.requests
    assert store.verify(1).ok


@pytest.mark.parametrize("change", ["removed", "truncated"])
def test_the_listing_still_refuses_an_object_that_vanished_or_changed(s3_uri: Location, change: str) -> None:
    uri, options = s3_uri
    store = CheckpointStore(uri, options)
    writer = store.begin(1)
    for i in range(5):
        writer.write_bytes(f"shard-{i:03d}.bin", b"x" * 64)
    path = f"{store.generation_path(1)}/shard-003.bin"
    if change == "removed":
        store.fs.rm_file(path)
    else:
        store.fs.pipe_file(path, b"x" * 10)  # another writer's object of another size at that name
    with pytest.raises(StorageError, match="NOT committed") as info:
        writer.commit()
    expected = "shard-003.bin: missing" if change == "removed" else "shard-003.bin: size 10, manifest says 64"
    assert expected in str(info.value)
    assert not store.fs.exists(f"{store.generation_path(1)}/{MANIFEST_NAME}")
    assert [g.step for g in store.generations()] == []


@pytest.mark.parametrize("objects", [1, 20])
def test_the_request_model_matches_a_measured_save_and_resume(s3_uri: Location, objects: int) -> None:
    from lightning_async_ckpt.tools.request_model import predict_resume, predict_save

    uri, options = s3_uri
    measured_save = _counts_of_a_later_save(uri, options, objects)
    # Retention listed 3 generations (steps 1, 2, 3) and kept 2.
    assert measured_save == predict_save(objects=objects, generations=3, keep_last=2).requests
    reader = CheckpointStore(uri, options, check_writable=False)
    with s3_requests() as log:
        assert reader.latest().step == 3
    assert dict(log.counts()) == predict_resume(objects=objects, generations=2).requests, log.requests


def test_a_store_whose_listing_names_differ_from_its_paths_still_commits(tmp_path, monkeypatch):
    # faulty:// over a relative local root lists absolute names; the one-listing check must still find the objects
    # (docs/testing.md's first example: an injected write error, then the retry commits).
    import torch

    from lightning_async_ckpt import AsyncCheckpointer
    from lightning_async_ckpt.testing import Fault

    monkeypatch.chdir(tmp_path)
    fault = Fault(op="write", path="checkpoint.ckpt", at=2, error="oserror")
    store = CheckpointStore("faulty://ckpt-demo", {"target_protocol": "file", "faults": [fault]})
    with AsyncCheckpointer(store, retries=2, retry_backoff_s=0.0) as ckpt:
        assert ckpt.save(1, {"w": torch.ones(1000)}).result(timeout=60).step == 1
    assert CheckpointStore("ckpt-demo").verify(1).ok
