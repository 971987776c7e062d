"""Request counts on a real S3 API (moto server, every request logged server side; issue 27 items 1, 2).

Generations are made cheaply through the library (one tiny object each). Counts are exact:
- ``latest_checkpoint()`` and ``store.latest()`` with an intact newest generation: the listing plus the newest's
  manifest, its size and its bytes (3 requests), at 10 and at 1,000 generations;
- one save with ``keep_last=2`` after the first (the ledger is built once per store): the same requests at 10 and
  at 1,000 generations, +/- listing pages;
- the first save of a new store with ``keep_last=2`` beside another run's history (its first retention pass reads
  down to the end of its run's lineage only, issue 40): the same at 10 and at 1,000, +/- listing pages.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from lightning_async_ckpt import latest_checkpoint
from lightning_async_ckpt.storage.io import Checksum
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.s3_requests import s3_requests

Location = tuple[str, dict[str, Any]]


def _fill(uri: str, options: dict[str, Any], count: int, *, run_id: str = "filler") -> CheckpointStore:
    """``count`` committed generations (steps 0 .. count-1) of one tiny object each, written in one batch.

    Each is what a writer commits (the object, then a manifest from the library's ``Manifest``), without the
    claim and the checks a real save makes, so that 1,000 generations take seconds.
    """
    store = CheckpointStore(uri, options, run_id=run_id)
    data = b"x" * 16
    digest = Checksum(store.checksum)
    digest.update(data)
    entry = ObjectEntry(name="checkpoint.ckpt", size=len(data), checksum=digest.hexdigest())
    files = {}
    for step in range(count):
        manifest = Manifest(step=step, run_id=run_id, objects=(entry,), committed_at=1000.0 + step)
        files[f"{store.generation_path(step)}/checkpoint.ckpt"] = data
        files[f"{store.generation_path(step)}/manifest.json"] = manifest.to_json()
    store.fs.pipe(files)
    store.invalidate_cache()
    return store


def _save(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", b"y" * 16)
    writer.commit()
    store.gc(2)


@pytest.mark.parametrize("generations", [10, pytest.param(1000, marks=pytest.mark.slow)])
def test_latest_checkpoint_reads_one_manifest_when_the_newest_is_intact(s3_uri: Location, generations: int) -> None:
    uri, options = s3_uri
    _fill(uri, options, generations)
    with s3_requests() as log:
        path = latest_checkpoint(uri, options)
    assert path is not None and path.endswith(f"step-{generations - 1:08d}/checkpoint.ckpt")
    pages = -(-generations // 1000)  # S3 lists 1,000 names a page
    # LIST of dirpath, then GET manifest, HEAD (size), GET (bytes) of the newest generation.
    assert log.counts() == {"LIST": pages, "GET": 2, "HEAD": 1}, log.requests


@pytest.mark.parametrize("generations", [10, pytest.param(1000, marks=pytest.mark.slow)])
def test_store_latest_reads_one_manifest_when_the_newest_is_intact(s3_uri: Location, generations: int) -> None:
    uri, options = s3_uri
    _fill(uri, options, generations)
    store = CheckpointStore(uri, options, check_writable=False)
    with s3_requests() as log:
        info = store.latest()
    assert info is not None and info.step == generations - 1
    assert log.counts() == {"LIST": -(-generations // 1000), "GET": 2, "HEAD": 1}, log.requests


def test_latest_falls_back_past_a_torn_and_an_uncommitted_newest(s3_uri: Location) -> None:
    """Older manifests are read only while newer ones fail; the newest intact one still wins."""
    uri, options = s3_uri
    store = _fill(uri, options, 5)
    store.fs.pipe_file(f"{store.generation_path(6)}/manifest.json", b"{torn")
    store.fs.pipe_file(f"{store.generation_path(7)}/checkpoint.ckpt", b"no manifest yet")
    reader = CheckpointStore(uri, options, check_writable=False)
    with s3_requests() as log, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        info = reader.latest()
    assert info is not None and info.step == 4
    manifest_gets = [t for m, t, _ in log.requests if m == "GET" and t.endswith("/manifest.json")]
    assert [t.rsplit("/", 2)[-2] for t in manifest_gets] == ["step-00000007", "step-00000006", "step-00000004"]


def _one_save(uri: str, options: dict[str, Any], generations: int) -> dict[str, int]:
    _fill(uri, options, generations, run_id="other-run")  # another run's history: never read per save
    store = CheckpointStore(uri, options, run_id="this-run")
    _save(store, generations)
    _save(store, generations + 1)  # the first pass builds the ledger (reads every manifest once)
    with s3_requests() as log:
        _save(store, generations + 2)
    assert [g.step for g in store.generations() if g.run_id == "this-run"] == [generations + 1, generations + 2]
    counts = dict(log.counts())
    counts.pop("LIST")
    return counts


@pytest.mark.slow  # 1,000 generations on moto: about a minute
def test_one_save_with_keep_last_costs_the_same_at_10_and_1000_generations(
    request: pytest.FixtureRequest, s3_endpoint: str
) -> None:
    small_uri, small_options = request.getfixturevalue("s3_uri")
    small = _one_save(small_uri, small_options, 10)
    big = _one_save(small_uri.replace("/ckpt", "/big"), small_options, 1000)
    assert small == big, (small, big)
    # Writing (claim, object, manifest), the commit's size checks, the kept generations' manifests and sizes, the
    # removed generation's manifest, and removing it: no read grows with the generations in the folder.
    assert sum(small.values()) <= 20, small


def _first_save(uri: str, options: dict[str, Any], generations: int) -> dict[str, int]:
    _fill(uri, options, generations, run_id="other-run")
    store = CheckpointStore(uri, options, run_id="this-run")
    with s3_requests() as log:
        _save(store, generations)
    assert len(store.generations()) == generations + 1
    counts = dict(log.counts())
    counts.pop("LIST")
    return counts


@pytest.mark.slow  # 1,000 generations on moto: about a minute
def test_the_first_save_of_a_new_store_costs_the_same_at_10_and_1000_generations(
    request: pytest.FixtureRequest, s3_endpoint: str
) -> None:
    uri, options = request.getfixturevalue("s3_uri")
    small = _first_save(uri, options, 10)
    big = _first_save(uri.replace("/ckpt", "/big"), options, 1000)
    assert small == big, (small, big)
    assert sum(small.values()) <= 16, small  # was 2 requests per generation: every manifest read once
