"""CheckpointStore over a local folder, ``memory://`` and S3 (moto on loopback).

Every damaging scenario ends with the same check: the previous committed generation still loads.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import textwrap
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_async_ckpt.errors import (
    ConfigError,
    GenerationExistsError,
    ManifestError,
    WriterUsageError,
)
from lightning_async_ckpt.storage.manifest import FORMAT_VERSION, MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.storage.writer import CLAIM_NAME
from tests.helpers.forked import start_script

CKPT = "checkpoint.ckpt"
EXTRA = "extra/notes.bin"
REPO_ROOT = Path(__file__).resolve().parents[2]
Location = tuple[str, dict[str, Any] | None]


# -- helpers ----------------------------------------------------------------------------------------------
@pytest.fixture(params=["local", "memory", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """Where a store lives: ``(uri, storage_options)`` for each backend."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    if request.param == "memory":
        return request.getfixturevalue("memory_uri"), None
    return request.getfixturevalue("s3_uri")


def _store(location: Location, **kwargs: Any) -> CheckpointStore:
    uri, options = location
    return CheckpointStore(uri, options, **kwargs)


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "weight": torch.full((64,), float(step)), "nested": {"bias": torch.arange(step + 1)}}


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    with writer.open(CKPT) as stream:
        torch.save(_state(step), stream)
    writer.write_bytes(EXTRA, b"extra bytes of step %d" % step)
    writer.commit(cut={"step": step, "epoch": 0})


def _load(store: CheckpointStore, step: int) -> dict[str, Any]:
    with store.open(step, CKPT) as f:
        return torch.load(f, weights_only=True)


def _assert_loads(store: CheckpointStore, step: int) -> None:
    state = _load(store, step)
    assert state["step"] == step
    assert torch.equal(state["weight"], torch.full((64,), float(step)))
    assert torch.equal(state["nested"]["bias"], torch.arange(step + 1))
    assert store.verify(step).ok


def _manifest_url(store: CheckpointStore, step: int) -> str:
    return f"{store.url(step)}/{MANIFEST_NAME}"


def _steps(store: CheckpointStore, include_uncommitted: bool = False) -> list[tuple[int, bool]]:
    return [(g.step, g.committed) for g in store.generations(include_uncommitted=include_uncommitted)]


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    """Turn any warning inside the block into a test failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- write, commit, read ----------------------------------------------------------------------------------
def test_commit_list_latest_open_verify(location: Location) -> None:
    store = _store(location, run_id="run-a")
    assert store.generations() == []
    assert store.latest() is None
    _commit(store, 1)
    _commit(store, 20)

    assert _steps(store) == [(1, True), (20, True)]
    info = store.latest()
    assert info is not None and info.step == 20 and info.committed and info.run_id == "run-a"
    manifest = info.manifest
    assert manifest is not None
    assert [o.name for o in manifest.objects] == [CKPT, EXTRA]
    assert manifest.cut == {"step": 20, "epoch": 0}
    assert manifest.format_version == FORMAT_VERSION
    assert "torch" in manifest.versions and "fsspec" in manifest.versions
    assert store.manifest(20) == manifest
    assert store.fs.cat_file(store.url(20, EXTRA)) == b"extra bytes of step 20"
    for step in (1, 20):
        _assert_loads(store, step)
    assert [(obj.name, url) for obj, url in store.iter_objects(1)] == [
        (CKPT, store.url(1, CKPT)),
        (EXTRA, store.url(1, EXTRA)),
    ]
    # A second store (another process, another run) sees the same committed generations.
    reader = _store(location, run_id="reader")
    assert reader.latest().step == 20
    _assert_loads(reader, 1)


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_streaming_writer_counts_size_and_checksum(location: Location, checksum: str) -> None:
    store = _store(location, checksum=checksum)
    chunks: list[Any] = [b"header", bytearray(b"\x00\xff" * 1000), memoryview(os.urandom(70_000))]
    chunks.append(array.array("d", [1.5] * 333))  # a typed buffer is written as its raw bytes
    expected = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    writer = store.begin(7)
    with writer.open("data/blob.bin") as stream:
        for chunk in chunks:
            assert stream.write(chunk) == memoryview(chunk).nbytes
        assert stream.tell() == len(expected)
    (entry,) = writer.objects
    if checksum == "crc32":
        assert entry.checksum == f"crc32:{zlib.crc32(expected):08x}"
    else:
        assert entry.checksum == f"sha256:{hashlib.sha256(expected).hexdigest()}"
    assert entry.size == len(expected)
    manifest = writer.commit()
    assert manifest.objects == (entry,)
    assert store.fs.cat_file(store.url(7, "data/blob.bin")) == expected
    assert store.verify(7).ok
    with store.open(7, "data/blob.bin") as f:
        assert f.read() == expected


def test_committed_step_is_never_overwritten(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    with pytest.raises(GenerationExistsError, match="already committed"):
        store.begin(1)
    # Another store instance (a restarted run) is refused too.
    with pytest.raises(GenerationExistsError, match="already committed"):
        _store(location).begin(1)
    _assert_loads(store, 1)


def test_one_writer_per_step_and_writer_lifecycle(location: Location) -> None:
    store = _store(location)
    writer = store.begin(3)
    with pytest.raises(GenerationExistsError, match="being written"):
        store.begin(3)
    stream = writer.open(CKPT)
    stream.write(b"abc")
    with pytest.raises(WriterUsageError, match="still open"):
        writer.commit()
    with pytest.raises(WriterUsageError, match="already written"):
        writer.open(CKPT)
    stream.close()
    stream.close()  # idempotent
    with pytest.raises(WriterUsageError, match="already written"):
        writer.open(CKPT)
    writer.commit()
    with pytest.raises(WriterUsageError, match="already committed or aborted"):
        writer.open("late.bin")
    with pytest.raises(WriterUsageError, match="already committed or aborted"):
        writer.commit()
    writer.abort()  # a late abort never removes a committed generation
    assert _steps(store) == [(3, True)]
    assert store.verify(3).ok


def test_failed_write_is_not_recorded(location: Location) -> None:
    store = _store(location)
    writer = store.begin(4)
    with pytest.raises(RuntimeError, match="serializer failed"), writer.open("broken.bin") as stream:
        stream.write(b"partial")
        raise RuntimeError("serializer failed")
    assert writer.objects == ()
    writer.write_bytes(CKPT, b"good")
    assert [o.name for o in writer.commit().objects] == [CKPT]


def test_abort_removes_data(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    writer = store.begin(2)
    writer.write_bytes(CKPT, os.urandom(10_000))
    writer.write_bytes(EXTRA, b"x")
    assert _steps(store, include_uncommitted=True) == [(1, True), (2, False)]
    writer.abort()
    writer.abort()  # idempotent
    assert _steps(store, include_uncommitted=True) == [(1, True)]
    assert not store.fs.exists(store.url(2))
    with pytest.raises(WriterUsageError, match="already committed or aborted"):
        writer.commit()
    # The step is free again once aborted.
    _commit(store, 2)
    assert store.latest().step == 2
    _assert_loads(store, 1)


# -- leftovers and retention ------------------------------------------------------------------------------
def test_uncommitted_leftover_is_skipped_and_collected_only_after_a_newer_commit(location: Location) -> None:
    store = _store(location, run_id="a")
    _commit(store, 1)
    # A writer of another process that died before its manifest: data, no commit.
    crashed = _store(location, run_id="crashed").begin(2)
    crashed.write_bytes(CKPT, b"half a checkpoint")
    with _no_warnings():
        assert store.latest().step == 1  # a leftover without a manifest is not even worth a warning
    assert _steps(store) == [(1, True)]
    assert _steps(store, include_uncommitted=True) == [(1, True), (2, False)]
    with pytest.raises(ManifestError, match="not committed"):
        store.open(2, CKPT)
    assert not store.verify(2).ok

    # Newer than the newest commit: it may still be in progress elsewhere, so gc leaves it.
    assert store.gc(keep_last=1) == []
    assert _steps(store, include_uncommitted=True) == [(1, True), (2, False)]

    _commit(store, 3)
    # Another run's leftover may be that run's save in progress: this run's retention never removes it, and
    # says so; the operator acting for the whole folder (all_runs) does.
    report = store.retain(keep_last=1)
    assert report.removed == [1] and report.failed == []
    assert [(r.step, "written by crashed" in r.reason) for r in report.refused] == [(2, True)]
    assert _steps(store, include_uncommitted=True) == [(2, False), (3, True)]
    assert store.gc(keep_last=1, all_runs=True, dry_run=True) == [2]
    assert store.gc(keep_last=1, all_runs=True) == [2]
    assert _steps(store, include_uncommitted=True) == [(3, True)]
    _assert_loads(store, 3)


def test_gc_never_touches_a_generation_this_store_is_writing(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    slow = store.begin(2)
    slow.write_bytes(EXTRA, b"first object of a slow save")
    _commit(store, 3)
    assert store.gc(keep_last=1) == [1]  # step 2 is older than the newest commit but still being written
    with slow.open(CKPT) as stream:
        torch.save(_state(2), stream)
    slow.commit()
    assert _steps(store) == [(2, True), (3, True)]
    _assert_loads(store, 2)
    assert store.gc(keep_last=1) == [2]
    assert _steps(store, include_uncommitted=True) == [(3, True)]


def test_gc_keeps_newest_and_leaves_other_runs_alone(location: Location) -> None:
    first = _store(location, run_id="first-run")
    for step in (1, 2, 3):
        _commit(first, step)
    second = _store(location, run_id="second-run")
    for step in (4, 5, 6):
        _commit(second, step)

    assert second.gc(keep_last=2) == [4]
    assert _steps(second) == [(1, True), (2, True), (3, True), (5, True), (6, True)]
    assert second.latest(run_id="first-run").step == 3
    assert second.gc(keep_last=2) == []  # idempotent

    assert second.gc(keep_last=2, all_runs=True, dry_run=True) == [1, 2, 3]
    assert len(second.generations()) == 5
    assert second.gc(keep_last=2, all_runs=True) == [1, 2, 3]
    assert _steps(second, include_uncommitted=True) == [(5, True), (6, True)]
    for step in (5, 6):
        _assert_loads(second, step)
    assert second.latest(run_id="first-run") is None


def test_gc_without_commits_removes_nothing(location: Location) -> None:
    store = _store(location)
    store.begin(1).write_bytes(CKPT, b"orphan")
    assert store.gc(keep_last=1, all_runs=True) == []
    assert _steps(store, include_uncommitted=True) == [(1, False)]


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5, "2", None])
def test_gc_rejects_bad_keep_last_before_removing_anything(location: Location, keep_last: Any) -> None:
    store = _store(location)
    for step in (1, 2, 3):
        _commit(store, step)
    with pytest.raises(ConfigError, match="keep_last"):
        store.gc(keep_last=keep_last)
    assert _steps(store) == [(1, True), (2, True), (3, True)]


class _DeleteRecorder:
    """Wraps a filesystem's ``rm_file``/``rm`` to record each deletion and whether the manifest still existed."""

    def __init__(self, store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, fail_rm: bool = False) -> None:
        self.store = store
        self.events: list[tuple[str, str, bool]] = []
        self.fail_rm = fail_rm
        fs = store.fs
        orig_rm_file, orig_rm = fs.rm_file, fs.rm

        def rm_file(path: str, *args: Any, **kwargs: Any) -> Any:
            self.events.append(("rm_file", str(path).rstrip("/"), self._manifest_exists(path)))
            if self.fail_rm and not str(path).endswith(MANIFEST_NAME):
                raise OSError("injected: crashed after the manifest was removed")
            return orig_rm_file(path, *args, **kwargs)

        def rm(path: str, *args: Any, **kwargs: Any) -> Any:
            self.events.append(("rm", str(path).rstrip("/"), self._manifest_exists(path)))
            if self.fail_rm:
                raise OSError("injected: crashed after the manifest was removed")
            return orig_rm(path, *args, **kwargs)

        # Patch the instance: s3fs binds its sync methods per instance.
        monkeypatch.setattr(fs, "rm_file", rm_file)
        monkeypatch.setattr(fs, "rm", rm)

    def _manifest_exists(self, path: str) -> bool:
        match = re.search(r"step-(\d{8})", str(path))
        return bool(match) and self.store.fs.exists(_manifest_url(self.store, int(match.group(1))))

    def for_step(self, step: int) -> list[tuple[str, str, bool]]:
        name = f"step-{step:08d}"
        return [e for e in self.events if name in e[1]]


def test_gc_removes_the_manifest_before_any_data(location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(location)
    for step in (1, 2, 3):
        _commit(store, step)
    recorder = _DeleteRecorder(store, monkeypatch)
    assert store.gc(keep_last=1) == [1, 2]
    for step in (1, 2):
        events = recorder.for_step(step)
        assert events, f"no deletion seen for step {step}"
        op, path, _ = events[0]
        assert op == "rm_file" and path.endswith(f"step-{step:08d}/{MANIFEST_NAME}"), events
        # Every later deletion of this generation's data happens with the manifest already gone.
        assert all(not manifest_existed for _, _, manifest_existed in events[1:]), events
    assert _steps(store, include_uncommitted=True) == [(3, True)]
    _assert_loads(store, 3)


def test_gc_interrupted_after_the_manifest_leaves_an_uncommitted_leftover(
    location: Location, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(location)
    _commit(store, 1)
    _commit(store, 2)
    with monkeypatch.context() as patch:
        _DeleteRecorder(store, patch, fail_rm=True)
        with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt.storage.store"):
            assert store.gc(keep_last=1) == []  # best effort: the failure is logged, not raised
    assert "could not remove generation" in caplog.text
    # Never a manifest without data: step 1 lost its manifest first and keeps its data as a leftover.
    assert not store.fs.exists(_manifest_url(store, 1))
    assert store.fs.exists(store.url(1, CKPT))
    assert _steps(store, include_uncommitted=True) == [(1, False), (2, True)]
    with _no_warnings():
        assert store.latest().step == 2
    # The next gc collects the leftover.
    assert store.gc(keep_last=1) == [1]
    assert _steps(store, include_uncommitted=True) == [(2, True)]
    _assert_loads(store, 2)


# -- damaged and hostile generations ----------------------------------------------------------------------
def _good_manifest_body(store: CheckpointStore, step: int) -> dict[str, Any]:
    return json.loads(store.fs.cat_file(_manifest_url(store, step)))


def _with(body: dict[str, Any], **changes: Any) -> bytes:
    return json.dumps({**body, **changes}).encode()


def _with_object(body: dict[str, Any], **changes: Any) -> bytes:
    objects = [dict(body["objects"][0], **changes), *body["objects"][1:]]
    return _with(body, objects=objects)


_HOSTILE_MANIFESTS = {
    "corrupt json": lambda body: b'{"format": "lightning_async_ckpt", "step": ',
    "binary garbage": lambda body: os.urandom(64),
    "empty file": lambda body: b"",
    "deep nesting": lambda body: b"[" * 100_000 + b"]" * 100_000,
    "string step": lambda body: _with(body, step="2"),
    "objects not a list": lambda body: _with(body, objects={"checkpoint.ckpt": 1}),
    "missing run_id": lambda body: json.dumps({k: v for k, v in body.items() if k != "run_id"}).encode(),
    "dotdot name": lambda body: _with_object(body, name="../step-00000001/checkpoint.ckpt"),
    "absolute name": lambda body: _with_object(body, name="/etc/passwd"),
    "url name": lambda body: _with_object(body, name="s3://other-bucket/secret"),
    "empty name": lambda body: _with_object(body, name=""),
    "absurd size": lambda body: _with_object(body, size=1 << 62),
    "negative size": lambda body: _with_object(body, size=-5),
    "newer format": lambda body: _with(body, format_version=FORMAT_VERSION + 1),
    "duplicate names": lambda body: _with(body, objects=[body["objects"][0], body["objects"][0]]),
    "another step's manifest": lambda body: _with(body, step=1),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_MANIFESTS))
def test_hostile_manifest_falls_back_to_previous_generation(location: Location, case: str) -> None:
    store = _store(location)
    _commit(store, 1)
    _commit(store, 2)
    store.fs.pipe_file(_manifest_url(store, 2), _HOSTILE_MANIFESTS[case](_good_manifest_body(store, 2)))

    with pytest.warns(UserWarning, match="skipping generation .*step-00000002"):
        info = store.latest()
    assert info is not None and info.step == 1
    _assert_loads(store, 1)
    assert _steps(store) == [(1, True)]
    (bad,) = [g for g in store.generations(include_uncommitted=True) if g.step == 2]
    assert not bad.committed and bad.error
    with pytest.raises(ManifestError):
        store.open(2, CKPT)
    with pytest.raises(ManifestError):
        store.manifest(2)
    assert not store.verify(2).ok
    _commit(store, 3)
    if case == "newer format":
        # Written by a newer version of the library: never overwritten, never collected (an upgrade reads it).
        with pytest.raises(GenerationExistsError):
            store.begin(2)
        assert 2 not in store.gc(keep_last=1)
        return
    # A rejected manifest never made the generation recoverable: gc collects it once a newer commit exists...
    assert 2 in store.gc(keep_last=1)
    assert _steps(store, include_uncommitted=True) == [(3, True)]


@pytest.mark.parametrize("case", sorted(set(_HOSTILE_MANIFESTS) - {"newer format"}))
def test_a_step_with_a_rejected_manifest_can_be_written_again(tmp_path: Path, case: str) -> None:
    # ...and a writer of that step (a run resumed from an earlier generation) rewrites it instead of failing.
    store = CheckpointStore(str(tmp_path / "ckpt"))
    _commit(store, 1)
    _commit(store, 2)
    store.fs.pipe_file(_manifest_url(store, 2), _HOSTILE_MANIFESTS[case](_good_manifest_body(store, 2)))
    _commit(store, 2)
    assert store.verify(2).ok and store.verify(1).ok


def test_manifest_that_is_not_a_file_is_untrusted(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    _commit(store, 1)
    writer = store.begin(2)
    writer.write_bytes(CKPT, b"x")
    os.makedirs(_manifest_url(store, 2))  # a folder where the manifest should be
    with pytest.warns(UserWarning, match="unreadable manifest"):
        assert store.latest().step == 1
    writer.abort()


def _rewrite_object(store: CheckpointStore, step: int, name: str, change) -> None:
    url = store.url(step, name)
    store.fs.pipe_file(url, change(bytearray(store.fs.cat_file(url))))


def test_truncated_object_is_skipped_by_latest(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    _commit(store, 2)
    _rewrite_object(store, 2, CKPT, lambda data: bytes(data[: len(data) // 2]))
    with pytest.warns(UserWarning, match=r"step-00000002.*checkpoint.ckpt: size"):
        assert store.latest().step == 1
    result = store.verify(2)
    assert not result.ok and any("size" in p for p in result.problems)
    _assert_loads(store, 1)


def test_missing_object_is_skipped_by_latest(location: Location) -> None:
    store = _store(location)
    _commit(store, 1)
    _commit(store, 2)
    store.fs.rm_file(store.url(2, EXTRA))
    with pytest.warns(UserWarning, match=r"extra/notes.bin: missing"):
        assert store.latest().step == 1
    assert store.verify(2).problems == (f"{EXTRA}: missing",)
    _assert_loads(store, 1)


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_flipped_byte_is_caught_by_verify(location: Location, checksum: str) -> None:
    store = _store(location, checksum=checksum)
    _commit(store, 1)
    _commit(store, 2)

    def flip(data: bytearray) -> bytes:
        data[len(data) // 2] ^= 0xFF
        return bytes(data)

    _rewrite_object(store, 2, CKPT, flip)
    with _no_warnings():
        assert store.latest(verify=False).step == 2  # same size: only reading the bytes can tell
    result = store.verify(2)
    assert not result.ok
    assert len(result.problems) == 1 and result.problems[0].startswith(f"{CKPT}: checksum {checksum}:")
    # Resuming verifies by default: the bit flip is never loaded, the previous generation is.
    with pytest.warns(UserWarning, match=r"step-00000002.*checksum"):
        assert store.latest().step == 1
    with pytest.warns(UserWarning, match=r"step-00000002.*checksum"):
        assert store.latest(verify=True).step == 1
    _assert_loads(store, 1)


# -- bad configuration: refused before anything is written ------------------------------------------------
@pytest.mark.parametrize(
    ("uri", "kwargs", "match"),
    [
        ("foo://x", {}, "unknown scheme 'foo'"),
        ("", {}, "uri"),
        ("   ", {}, "uri"),
        (None, {}, "uri"),
        ("memory://lac-bad", {"storage_options": ["endpoint"]}, "storage_options"),
        ("memory://lac-bad", {"checksum": "md5"}, "checksum"),
        ("memory://lac-bad", {"block_size": 1 << 20}, "block_size"),
        ("memory://lac-bad", {"block_size": 8.5e6}, "block_size"),
    ],
)
def test_bad_arguments_are_config_errors(uri: Any, kwargs: dict[str, Any], match: str) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    with pytest.raises(ConfigError, match=match):
        CheckpointStore(uri, **kwargs)
    assert not MemoryFileSystem().exists("/lac-bad")


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_missing_backend_names_the_package_to_install() -> None:
    with pytest.raises(ConfigError, match=r"pip install gcsfs"):
        CheckpointStore("gs://bucket/ckpt")


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_unwritable_location_is_a_config_error(tmp_path: Path, scheme: str) -> None:
    # Tests may run as root, where permission bits do not block writes; a path below a regular file can
    # never be created by anyone.
    blocker = tmp_path / "afile"
    blocker.write_bytes(b"not a folder")
    with pytest.raises(ConfigError, match="not writable"):
        CheckpointStore(f"{scheme}{blocker / 'sub' / 'ckpt'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert blocker.read_bytes() == b"not a folder"


@pytest.mark.parametrize("step", [-1, True, 1.0, "3", None])
def test_bad_step_is_refused_before_writing(location: Location, step: Any) -> None:
    store = _store(location)
    with pytest.raises(ConfigError, match="step"):
        store.begin(step)
    assert store.generations(include_uncommitted=True) == []
    store.begin(0).abort()  # the refused call left nothing reserved


@pytest.mark.parametrize("name", ["../escape.bin", "/abs.bin", "s3://other/x", "", "a/../../b", MANIFEST_NAME])
def test_hostile_object_name_is_refused_before_writing(tmp_path: Path, name: str) -> None:
    store = CheckpointStore(str(tmp_path / "root" / "ckpt"))
    writer = store.begin(1)
    with pytest.raises(ManifestError):
        writer.open(name)
    writer.write_bytes(CKPT, b"ok")
    writer.commit()
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and p.name != CLAIM_NAME)
    assert written == [f"root/ckpt/step-00000001/{CKPT}", f"root/ckpt/step-00000001/{MANIFEST_NAME}"]


# -- S3 specifics -----------------------------------------------------------------------------------------
def test_s3_multipart_stream_and_bucket_root(s3_uri: Location) -> None:
    uri, options = s3_uri
    bucket_root = uri.rsplit("/", 1)[0]  # the bucket itself, no prefix
    store = CheckpointStore(bucket_root, options, block_size=5 << 20, checksum="crc32")
    writer = store.begin(1)
    chunk = os.urandom(1 << 20)
    crc = 0
    with writer.open(CKPT) as stream:
        for i in range(12):  # 12 MiB: three multipart parts
            piece = bytes([i]) + chunk[1:]
            stream.write(piece)
            crc = zlib.crc32(piece, crc)
    writer.commit()
    (entry,) = store.manifest(1).objects
    assert entry.size == 12 << 20 and entry.checksum == f"crc32:{crc:08x}"
    assert store.latest(verify=True).step == 1


# -- crash consistency --------------------------------------------------------------------------------------
_CRASH_WRITER = textwrap.dedent(
    """
    import json
    import os
    import sys

    import torch

    from lightning_async_ckpt.storage.store import CheckpointStore

    uri, options, phase = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    store = CheckpointStore(uri, options or None, run_id="crashed-run", block_size=5 << 20)
    first = store.begin(1)
    with first.open("checkpoint.ckpt") as stream:
        torch.save({"step": 1, "weight": torch.full((64,), 1.0), "nested": {"bias": torch.arange(2)}}, stream)
    first.write_bytes("extra/notes.bin", b"extra bytes of step 1")
    first.commit(cut={"step": 1})

    second = store.begin(2)
    second.write_bytes("extra/notes.bin", b"a complete object of the generation that never commits")


    def gate(what):
        print(what, flush=True)
        sys.stdin.readline()
        raise SystemExit("stdin closed: the parent was meant to kill this process")


    class GateAfter:
        # Passes writes through; once `limit` bytes went by, says so and blocks until killed.
        def __init__(self, raw, limit):
            self.raw, self.limit, self.count = raw, limit, 0

        def write(self, data):
            written = self.raw.write(data)
            self.count += written
            if self.count >= self.limit:
                self.raw.flush()
                gate("WRITING")
            return written

        def flush(self):
            self.raw.flush()


    payload = {"step": 2, "weight": torch.randn(3 << 20)}
    if phase == "data":
        stream = second.open("checkpoint.ckpt")
        torch.save(payload, GateAfter(stream, 6 << 20))
    else:
        # Every object is durable and the manifest's temporary file is written and fsynced; die before the
        # exclusive link that commits it.
        with second.open("checkpoint.ckpt") as stream:
            torch.save(payload, stream)
        os.link = lambda src, dst: gate("WRITING")
        second.commit()
    print("NOT REACHED", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("backend", "phase"),
    [("local", "data"), ("local", "manifest"), ("s3", "data")],
    ids=["local-data", "local-manifest", "s3-data"],
)
def test_sigkill_while_writing_keeps_the_previous_generation(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str, phase: str
) -> None:
    if backend == "local":
        uri, options = str(tmp_path / "ckpt"), None
    else:
        uri, options = request.getfixturevalue("s3_uri")
    script = tmp_path / "crash_writer.py"
    script.write_text(_CRASH_WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    # Forked from the session's zygote (torch imported once): a separate process, SIGKILLed at its gate.
    argv = [sys.executable, str(script), uri, json.dumps(options), phase]
    with start_script(argv, cwd=REPO_ROOT, env=env, stdin=True) as proc:
        line = proc.readline(timeout=120)
        assert line == "WRITING\n", f"writer did not reach the gate: {line!r}\n{proc.stderr}"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL

    store = CheckpointStore(uri, options)
    assert not store.fs.exists(_manifest_url(store, 2))
    assert _steps(store, include_uncommitted=True) == [(1, True), (2, False)]
    assert store.fs.exists(store.url(2, EXTRA))
    if backend == "s3":
        # The multipart upload never completed, so the object does not exist at all.
        assert not store.fs.exists(store.url(2, CKPT))
    elif phase == "data":
        # The kill landed mid-stream: a partial torch.save file is on disk, untrusted.
        assert os.path.getsize(store.url(2, CKPT)) >= 6 << 20
    else:
        # A complete, fsynced manifest under its temporary name is not a commit.
        leftovers = [p.name for p in Path(store.url(2)).iterdir() if p.name.startswith(f".{MANIFEST_NAME}.tmp")]
        assert len(leftovers) == 1
    with _no_warnings():
        info = store.latest()
    assert info is not None and info.step == 1 and info.run_id == "crashed-run"
    _assert_loads(store, 1)
    # A restarted run takes over the step: the leftover is replaced, then committed.
    _commit(store, 2)
    assert store.latest(verify=True).step == 2
    _assert_loads(store, 1)


# -- the test harness itself: the autouse thread-leak guard in conftest.py --------------------------------
@pytest.mark.slow
def test_thread_leak_guard_fails_only_leaking_tests(pytester: pytest.Pytester) -> None:
    conftest = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()
    assert "LEAK_JOIN_TIMEOUT_S = 5.0" in conftest
    pytester.makeconftest(conftest.replace("LEAK_JOIN_TIMEOUT_S = 5.0", "LEAK_JOIN_TIMEOUT_S = 0.2"))
    pytester.makepyfile(
        test_inner="""
        import threading

        def test_leaks_a_library_thread():
            gate = threading.Event()
            threading.Thread(target=gate.wait, name="lightning_async_ckpt-leaky", daemon=True).start()

        def test_thread_that_ends_during_the_join_wait():
            gate = threading.Event()
            thread = threading.Thread(target=gate.wait, name="lightning_async_ckpt-closing", daemon=True)
            thread.start()
            gate.set()

        def test_other_threads_are_not_ours():
            gate = threading.Event()
            threading.Thread(target=gate.wait, name="someone-else", daemon=True).start()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_a_library_thread*", "*lightning_async_ckpt-leaky*"])


def test_begin_rewrites_a_generation_whose_manifest_is_torn_but_never_one_from_a_newer_version(tmp_path) -> None:
    import json

    from lightning_async_ckpt.storage.manifest import FORMAT_VERSION

    store = CheckpointStore(str(tmp_path))
    gen = tmp_path / "step-00000003"
    gen.mkdir()
    (gen / MANIFEST_NAME).write_text('{"format": "lightning_async_ckpt", "step": 3, "obj')  # a torn write
    writer = store.begin(3)
    writer.write_bytes(CKPT, b"fresh")
    writer.commit()
    assert store.verify(3).ok

    newer = tmp_path / "step-00000004"
    newer.mkdir()
    body = json.loads((gen / MANIFEST_NAME).read_text())
    body.update(step=4, format_version=FORMAT_VERSION + 1)
    (newer / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(GenerationExistsError):
        store.begin(4)
    assert (newer / MANIFEST_NAME).exists()


def test_keep_last_counts_this_runs_generations_so_another_runs_newer_commits_do_not_evict_them(tmp_path) -> None:
    old = CheckpointStore(str(tmp_path), run_id="old-run")
    for step in (9000, 10000):
        _commit(old, step)
    new = CheckpointStore(str(tmp_path), run_id="new-run")
    _commit(new, 100)
    assert new.gc(keep_last=2) == []
    _commit(new, 200)
    _commit(new, 300)
    assert new.gc(keep_last=2) == [100]
    assert [g.step for g in new.generations()] == [200, 300, 9000, 10000]


def test_gc_never_deletes_a_generation_whose_manifest_cannot_be_read_right_now(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3):
        _commit(store, step)
    real_cat = store.fs.cat_file

    def flaky(path, *args, **kwargs):
        if "step-00000001" in str(path):
            raise OSError("503 SlowDown")
        return real_cat(path, *args, **kwargs)

    store.fs.cat_file = flaky
    try:
        assert store.gc(keep_last=1) == [2]
    finally:
        del store.fs.cat_file
    assert [g.step for g in store.generations()] == [1, 3]


def test_an_object_placed_at_another_file_name_is_found_by_its_name(tmp_path):
    store = CheckpointStore(str(tmp_path))
    writer = store.begin(3)
    writer.place(CKPT, "epoch=0-step=3.ckpt")
    writer.write_bytes(CKPT, b"payload")
    manifest = writer.commit()
    entry = manifest.object(CKPT)
    assert entry.key == "epoch=0-step=3.ckpt" and (tmp_path / "step-00000003" / "epoch=0-step=3.ckpt").exists()
    assert not (tmp_path / "step-00000003" / CKPT).exists()
    assert store.object_url(3, CKPT).endswith("step-00000003/epoch=0-step=3.ckpt")
    with store.open(3, CKPT) as f:
        assert f.read() == b"payload"
    assert store.verify(3).ok


@pytest.mark.parametrize("key", ["manifest.json", ".writer.json", "w-abc/x.ckpt", "../x.ckpt", "/abs.ckpt"])
def test_a_reserved_or_unsafe_file_name_is_refused(tmp_path, key):
    writer = CheckpointStore(str(tmp_path)).begin(1)
    with pytest.raises(ManifestError):
        writer.place(CKPT, key)
    writer.abort()


def test_two_objects_cannot_share_a_file(tmp_path):
    writer = CheckpointStore(str(tmp_path)).begin(1)
    writer.place(CKPT, "same.ckpt")
    with pytest.raises(WriterUsageError):
        writer.place("other.bin", "same.ckpt")
    writer.write_bytes("plain.bin", b"x")
    with pytest.raises(WriterUsageError):
        writer.place("another.bin", "plain.bin")  # the file of an object already written
    writer.abort()
