"""The first retention pass of a new store reads what the decision needs, not every manifest (issue 40 item 3).

A new store (another run's ``keep_last`` pass, a restarted job) knows nothing of its folder. Names give steps, so
the pass walks the generations newest first and reads the manifests only down to the end of this run's lineage
(the first committed generation of another run below this run's own), whatever the number of generations below.
Requests are counted on a real fsspec memory filesystem (``tests/helpers/counting_fs.py``); moto S3 figures are
in docs/benchmarks.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from lightning_async_ckpt.storage.io import Checksum
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.counting_fs import PROTOCOL, CountingMemoryFileSystem


@pytest.fixture
def uri() -> Iterator[str]:
    root = f"/lac-count-{uuid.uuid4().hex[:16]}"
    yield f"{PROTOCOL}://{root}"
    fs = CountingMemoryFileSystem()
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _fill(uri: str, steps: range, run_id: str) -> None:
    """Committed generations of one tiny object each, as a writer leaves them (object, then manifest)."""
    store = CheckpointStore(uri, run_id=run_id)
    data = b"x" * 16
    digest = Checksum(store.checksum)
    digest.update(data)
    entry = ObjectEntry(name="checkpoint.ckpt", size=len(data), checksum=digest.hexdigest())
    files = {}
    for step in steps:
        manifest = Manifest(step=step, run_id=run_id, objects=(entry,), committed_at=1000.0 + step)
        files[f"{store.generation_path(step)}/checkpoint.ckpt"] = data
        files[f"{store.generation_path(step)}/manifest.json"] = manifest.to_json()
    store.fs.pipe(files)


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", b"y" * 16)
    writer.commit()


def _another_runs_pass(uri: str, generations: int) -> tuple[int, list[int]]:
    """Another run's history of ``generations``; a new run commits once and runs its first pass (keep_last=2)."""
    _fill(uri, range(generations), "other-run")
    store = CheckpointStore(uri, run_id="this-run")
    _commit(store, generations)
    CountingMemoryFileSystem.calls.clear()
    removed = store.gc(2)
    return sum(CountingMemoryFileSystem.calls.values()), removed


def _restarted_pass(uri: str, generations: int) -> tuple[int, list[int]]:
    """Another run's history below a run's three newest; that run restarts, resumes, commits and retains."""
    _fill(uri, range(generations - 3), "other-run")
    _fill(uri, range(generations - 3, generations), "the-run")
    store = CheckpointStore(uri)
    assert store.resume(verify=False).step == generations - 1
    _commit(store, generations)
    CountingMemoryFileSystem.calls.clear()
    removed = store.gc(2)
    return sum(CountingMemoryFileSystem.calls.values()), removed


@pytest.mark.parametrize("scenario", [_another_runs_pass, _restarted_pass])
def test_a_new_stores_first_pass_costs_the_same_at_10_and_300_generations(uri: str, scenario) -> None:
    small, removed_small = scenario(uri + "/small", 10)
    big, removed_big = scenario(uri + "/big", 300)
    if scenario is _restarted_pass:
        assert (removed_small, removed_big) == ([7, 8], [297, 298])
    else:
        assert removed_small == removed_big == []
    assert abs(big - small) <= 3, (small, big)
    # Another run's generations are never removed, and every one of them is still there.
    for generations, sub in ((10, "/small"), (300, "/big")):
        listed = CheckpointStore(uri + sub, check_writable=False).generations()
        others = [g.step for g in listed if g.run_id == "other-run"]
        expected = generations if scenario is _another_runs_pass else generations - 3
        assert others == list(range(expected))


def test_two_runs_interleaving_steps_retire_their_own_generations_written_since(uri: str) -> None:
    """Names above the first pass's lineage end are looked at on every pass: another run's commits between this
    run's do not hide this run's older generations from its later passes."""
    _fill(uri, range(5), "other-run")
    mine = CheckpointStore(uri, run_id="this-run")
    _commit(mine, 5)
    assert mine.gc(2) == []
    _fill(uri, [6, 8], "other-run")
    _commit(mine, 7)
    _commit(mine, 9)
    assert mine.gc(2) == [5]
    listed = CheckpointStore(uri, check_writable=False).generations()
    assert [(g.step, g.run_id) for g in listed if g.run_id == "this-run"] == [(7, "this-run"), (9, "this-run")]
    assert [g.step for g in listed if g.run_id == "other-run"] == [0, 1, 2, 3, 4, 6, 8]


def test_this_runs_generations_below_another_runs_are_left_alone_until_a_pass_for_all_runs(uri: str) -> None:
    """Below the end of the lineage nothing is read or removed: a restarted run whose old generations lie under
    another run's keeps them (never a removal it did not prove), and the operator's pass for all runs sees them."""
    _fill(uri, range(3), "the-run")
    _fill(uri, range(3, 6), "other-run")
    store = CheckpointStore(uri, run_id="the-run")
    _commit(store, 6)
    _commit(store, 7)
    assert store.gc(1) == [6]
    assert [g.step for g in store.generations() if g.run_id == "the-run"] == [0, 1, 2, 7]
    assert store.gc(1, all_runs=True) == [0, 1, 2, 3, 4, 5]
