"""Issue 13's storage probes: nothing committed is ever lost, never a false commit, never a silent skip.

Each test reproduces one probe on real filesystems (local disk, ``memory://``, S3 on the moto server) and
asserts what must hold afterwards. Concurrency is gated with ``threading.Barrier``/``Event``, never sleeps.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_async_ckpt.errors import ConfigError, GenerationExistsError, StorageError
from lightning_async_ckpt.lightning import latest_checkpoint
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tools.cli import main

CKPT = "checkpoint.ckpt"
Location = tuple[str, dict[str, Any] | None]


@pytest.fixture(params=["local", "memory", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    if request.param == "memory":
        return request.getfixturevalue("memory_uri"), None
    return request.getfixturevalue("s3_uri")


def _store(location: Location, **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(location[0], location[1], **kwargs)


def _commit(store: CheckpointStore, step: int, fill: float | None = None) -> None:
    writer = store.begin(step)
    with writer.open(CKPT) as stream:
        torch.save({"step": step, "w": torch.full((256,), float(step if fill is None else fill))}, stream)
    writer.commit()


def _load(store: CheckpointStore, step: int) -> dict[str, Any]:
    with store.open(step, CKPT) as f:
        return torch.load(f, weights_only=True)


def _rewrite(store: CheckpointStore, step: int, change) -> None:
    url = store.url(step, CKPT)
    store.fs.pipe_file(url, change(bytearray(store.fs.cat_file(url))))


def _flip(data: bytearray) -> bytes:
    data[len(data) // 2] ^= 0x01
    return bytes(data)


# -- 1. retention counts only verified complete generations ------------------------------------------------
def test_gc_never_deletes_the_last_recoverable_generation_when_the_newest_is_truncated(location: Location) -> None:
    store = _store(location, run_id="a")
    for step in (1, 2, 3):
        _commit(store, step)
    _rewrite(store, 3, lambda data: bytes(data[: len(data) // 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        removed = store.gc(keep_last=1)
        assert removed == [1]  # step 2 is the newest complete one: kept
        assert store.latest().step == 2
    report = store.retain(keep_last=1)
    assert report.removed == [] and [r.step for r in report.refused] == [3]
    assert "not counted as recoverable" in report.refused[0].reason and "size" in report.refused[0].reason
    assert _load(store, 2)["step"] == 2


def test_gc_refuses_to_count_a_bit_flipped_generation(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), run_id="a")
    for step in (1, 2, 3):
        _commit(store, step)
    _rewrite(store, 3, _flip)  # same size: only the checksum can tell
    assert store.gc(keep_last=1, dry_run=True) == [1, 2]  # sizes only (after each commit): not caught
    report = store.retain(keep_last=1)  # checksums of small generations (what the CLI runs)
    assert report.removed == [1] and report.plan.keep == (2,)
    assert [r.step for r in report.refused] == [3] and "checksum" in report.refused[0].reason


def test_cli_gc_keep_last_with_a_truncated_newest_generation_keeps_a_recoverable_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = CheckpointStore(str(tmp_path), run_id="a")
    for step in (1, 2, 3):
        _commit(store, step)
    _rewrite(store, 3, lambda data: bytes(data[:100]))
    assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept step 3: not counted as recoverable" in out and "removed step 1" in out
    with pytest.warns(UserWarning, match="step-00000003"):
        assert latest_checkpoint(str(tmp_path)) == store.url(2, CKPT)


# -- 2. retention never deletes another writer's generation; a commit checks its objects ---------------------
def test_one_runs_retention_never_deletes_another_runs_save_in_progress(location: Location) -> None:
    a, b = _store(location, run_id="run-a"), _store(location, run_id="run-b")
    _commit(a, 1)
    writer_b = b.begin(2)  # run B writes an older step into the same dirpath, slowly
    with writer_b.open(CKPT) as stream:
        torch.save({"step": 2, "w": torch.ones(256)}, stream)
    for step in (3, 4):
        _commit(a, step)
        report = a.retain(keep_last=1)
        assert 2 not in report.removed
    assert any(r.step == 2 and "run-b" in r.reason for r in report.refused)
    writer_b.commit()
    assert b.verify(2).ok and _load(b, 2)["step"] == 2


def test_commit_fails_loudly_when_its_objects_vanished(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    writer = store.begin(2)
    writer.write_bytes(CKPT, b"x" * 1000)
    store.fs.rm_file(f"{store.generation_path(2)}/{CKPT}")  # another process's retention removed it
    with pytest.raises(StorageError, match="NOT committed") as info:
        writer.commit()
    assert "checkpoint.ckpt: missing" in str(info.value)
    assert not store.fs.exists(f"{store.generation_path(2)}/{MANIFEST_NAME}")
    assert [g.step for g in store.generations()] == [1]


# -- 3. exclusive commit --------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["claimant", "second"])
def test_two_writers_of_one_step_exactly_one_commits_and_its_data_stays(location: Location, first: str) -> None:
    one, two = _store(location, run_id="one"), _store(location, run_id="two")
    w1 = one.begin(5)
    w2 = two.begin(5)  # before either commits: w1 holds the claim, w2 writes under its own prefix
    with w1.open(CKPT) as s1, w2.open(CKPT) as s2:
        torch.save({"w": torch.full((256,), 1.0)}, s1)
        torch.save({"w": torch.full((256,), 2.0)}, s2)
    winner, loser = (w1, w2) if first == "claimant" else (w2, w1)
    winner.commit()
    with pytest.raises(GenerationExistsError, match="committed by another writer first"):
        loser.commit()
    assert one.verify(5).ok
    expected = 1.0 if first == "claimant" else 2.0
    assert torch.equal(_load(one, 5)["w"], torch.full((256,), expected))
    assert one.manifest(5).run_id == winner.store.run_id
    # The loser's data is gone, the winner's stays.
    folder = one.generation_path(5)
    data = [f for f in one.fs.find(folder) if not f.endswith((".writer.json", MANIFEST_NAME))]
    assert len(data) == 1


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_racing_commits_of_one_step_have_exactly_one_winner(request: pytest.FixtureRequest, tmp_path, kind) -> None:
    location = (str(tmp_path / "ckpt"), None) if kind == "local" else request.getfixturevalue("s3_uri")
    stores = [_store(location, run_id=f"r{i}") for i in range(4)]
    writers = [s.begin(7) for s in stores]
    for i, w in enumerate(writers):
        w.write_bytes(CKPT, bytes([i]) * 4096)
    barrier = threading.Barrier(len(writers))
    outcomes: list[str] = [""] * len(writers)

    def commit(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            writers[i].commit()
            outcomes[i] = "won"
        except GenerationExistsError:
            outcomes[i] = "lost"

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == ["lost", "lost", "lost", "won"]
    won = outcomes.index("won")
    assert stores[0].verify(7).ok and stores[0].manifest(7).run_id == f"r{won}"
    with stores[0].open(7, CKPT) as f:
        assert f.read() == bytes([won]) * 4096


# -- 4. resume verifies checksums ----------------------------------------------------------------------------
def test_resume_never_loads_a_flipped_bit(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    _commit(store, 2)
    _rewrite(store, 2, _flip)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.latest(verify=False).step == 2  # listings stay cheap
    with pytest.warns(UserWarning, match=r"step-00000002.*checksum"):
        assert store.latest().step == 1
    with pytest.warns(UserWarning, match=r"step-00000002.*checksum"):
        assert latest_checkpoint(location[0], location[1]) == store.url(1, CKPT)


# -- 7. an unlistable store is an error, never "no checkpoint" -----------------------------------------------
def test_missing_bucket_raises_instead_of_returning_none(s3_endpoint: str, capsys) -> None:
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    uri = "s3://no-such-bucket-lac/run"
    store = CheckpointStore(uri, options, check_writable=False)
    with pytest.raises(StorageError, match="no-such-bucket-lac"):
        store.latest()
    with pytest.raises(StorageError, match="no-such-bucket-lac"):
        latest_checkpoint(uri, options)
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-lac' does not exist"):
        CheckpointStore(uri, options)  # a writer fails before training
    argv = ["ls", uri, "--storage-option", f"endpoint_url={s3_endpoint}"]
    argv += ["--storage-option", "key=testing", "--storage-option", "secret=testing"]
    assert main(argv) == 2
    assert "no-such-bucket-lac" in capsys.readouterr().err


def test_unreachable_endpoint_raises_instead_of_returning_none() -> None:
    options = {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s"}
    options["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    with pytest.raises(StorageError, match="could not list"):
        CheckpointStore("s3://bucket/run", options, check_writable=False).latest()


def test_an_empty_bucket_and_a_local_folder_not_created_yet_are_empty(s3_uri: Location, tmp_path: Path) -> None:
    assert CheckpointStore(*s3_uri, check_writable=False).latest() is None
    assert latest_checkpoint(str(tmp_path / "not-yet")) is None


# -- 8. a failed S3 upload aborts its multipart upload -------------------------------------------------------
def test_failed_s3_upload_aborts_its_multipart_upload(s3_uri: Location) -> None:
    store = _store(s3_uri, block_size=5 << 20)
    bucket = store.root.split("/", 1)[0]
    writer = store.begin(1)
    key = f"{store.generation_path(1)}/{CKPT}"

    def uploads() -> list[Any]:
        return store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])

    with pytest.raises(RuntimeError, match="serializer failed"), writer.open(CKPT) as stream:
        stream.write(os.urandom(6 << 20))  # one part uploaded: a multipart upload is open
        stream.write(os.urandom(1 << 20))
        assert len(uploads()) == 1
        raise RuntimeError("serializer failed")
    assert uploads() == []
    store.fs.invalidate_cache()
    assert not store.fs.exists(key)  # the partial object was never published
    writer.abort()


# -- 9. hostile store content --------------------------------------------------------------------------------
def test_huge_manifest_is_refused_without_reading_it_whole(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    _commit(store, 2)
    path = f"{store.generation_path(2)}/{MANIFEST_NAME}"
    body = json.loads(store.fs.cat_file(path))
    body["extra"] = {"padding": "x" * (17 << 20)}  # valid JSON, just enormous
    store.fs.pipe_file(path, json.dumps(body).encode())
    with pytest.warns(UserWarning, match="larger than any manifest"):
        assert store.latest().step == 1


def test_objects_resolving_outside_the_root_through_symlinks_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    _commit(store, 1)
    _commit(store, 2)
    outside = tmp_path / "outside.bin"
    obj = root / "step-00000002" / CKPT
    outside.write_bytes(obj.read_bytes())  # same bytes: size and checksum would match
    obj.unlink()
    obj.symlink_to(outside)
    result = store.verify(2)
    assert not result.ok and "outside the store root" in result.problems[0]
    with pytest.warns(UserWarning, match="outside the store root"):
        assert store.latest().step == 1
    # A generation folder that is itself a symlink out of the root is skipped and named.
    (tmp_path / "elsewhere").mkdir()
    (root / "step-00000009").symlink_to(tmp_path / "elsewhere")
    listing = store.scan()
    assert [s.name for s in listing.skipped] == ["step-00000009"]


def test_non_canonical_generation_names_are_skipped_and_named(tmp_path: Path, capsys) -> None:
    store = CheckpointStore(str(tmp_path), run_id="a")
    for step in (2, 4):
        _commit(store, step)
    for name in ("step-000000004", "step-0000000\u0664"):  # 9 digits; an Arabic-Indic four
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST_NAME).write_bytes((tmp_path / "step-00000004" / MANIFEST_NAME).read_bytes())
    listing = store.scan()
    assert [g.step for g in listing.generations] == [2, 4]
    assert sorted(s.name for s in listing.skipped) == sorted(["step-000000004", "step-0000000\u0664"])
    assert store.gc(keep_last=1) == [2]
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped step-000000004: not a canonical generation name" in out
    assert main(["verify", str(tmp_path)]) == 0
    assert "skipped step-000000004" in capsys.readouterr().out


def test_a_leftover_of_this_run_id_held_by_another_live_process_is_not_removed(tmp_path: Path) -> None:
    import socket

    store = CheckpointStore(str(tmp_path), run_id="resumed")
    _commit(store, 1)
    # A predecessor of this run (same run id) that never died is still writing step 2.
    folder = tmp_path / "step-00000002"
    folder.mkdir()
    claim = {"run_id": "resumed", "step": 2, "token": "t", "host": socket.gethostname(), "pid": os.getppid()}
    (folder / ".writer.json").write_text(json.dumps({**claim, "started": 0.0}))
    (folder / CKPT).write_bytes(b"in progress")
    _commit(store, 3)
    report = store.retain(keep_last=1)
    assert report.removed == [1]
    assert [(r.step, "a live process" in r.reason) for r in report.refused] == [(2, True)]
    assert (folder / CKPT).exists()
