"""Manifest parsing: round trip, and every malformed or hostile manifest is a ManifestError (never a crash)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from lightning_async_ckpt.errors import ManifestError, StorageError
from lightning_async_ckpt.storage.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ObjectEntry,
    validate_object_name,
)


def _manifest() -> Manifest:
    return Manifest(
        step=100,
        run_id="run-a",
        objects=(
            ObjectEntry(name="checkpoint.ckpt", size=1234, checksum="crc32:0badf00d"),
            ObjectEntry(name="shards/rank-0.bin", size=0, checksum="sha256:" + "ab" * 32),
        ),
        cut={"step": 100, "epoch": 2, "requested_at": 1.5},
        versions={"torch": "2.14.1"},
        plan={"weights": "deferred"},
        timings={"staged": 0.25},
        extra={"note": "x"},
        committed_at=1700000000.5,
    )


def _body() -> dict[str, Any]:
    return json.loads(_manifest().to_json())


def test_round_trip_keeps_every_field() -> None:
    manifest = _manifest()
    data = manifest.to_json()
    body = json.loads(data)
    assert body["format"] == FORMAT_NAME
    assert body["format_version"] == FORMAT_VERSION
    assert Manifest.from_json(data) == manifest
    assert Manifest.from_json(data.decode("utf-8")) == manifest
    assert manifest.total_bytes == 1234
    assert manifest.object("shards/rank-0.bin").size == 0
    with pytest.raises(KeyError, match="no object 'nope'"):
        manifest.object("nope")


def test_optional_sections_default_to_empty() -> None:
    body = _body()
    for key in ("cut", "versions", "plan", "timings", "extra", "committed_at"):
        del body[key]
    manifest = Manifest.from_json(json.dumps(body))
    assert manifest.cut == {} and manifest.extra == {} and manifest.committed_at == 0.0


def test_manifest_error_is_a_storage_error_and_an_exception() -> None:
    assert issubclass(ManifestError, StorageError)
    assert issubclass(ManifestError, Exception)


@pytest.mark.parametrize(
    "name", ["checkpoint.ckpt", "sub/dir/x.bin", "a.b-c_d", "step-00000001.ckpt", "sub/manifest.json"]
)
def test_plain_names_are_accepted(name: str) -> None:
    assert validate_object_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        None,
        7,
        "..",
        "../x",
        "a/../../x",
        "./x",
        "a/./b",
        "a//b",
        "a/",
        "/etc/passwd",
        "//host/share",
        "s3://other-bucket/x",
        "file:///etc/passwd",
        "C:\\Windows\\x",
        "a\\..\\b",
        "a\x00b",
        "line\nbreak",
        MANIFEST_NAME,
    ],
)
def test_hostile_names_are_rejected(name: object) -> None:
    with pytest.raises(ManifestError):
        validate_object_name(name)


def _set(path: tuple, value: Any):
    def mutate(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple):
    def mutate(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def _duplicate_first_object(body: dict) -> None:
    body["objects"].append(copy.deepcopy(body["objects"][0]))


_HOSTILE_BODIES = {
    "missing format": _delete(("format",)),
    "other format": _set(("format",), "orbax"),
    "missing format_version": _delete(("format_version",)),
    "newer format_version": _set(("format_version",), FORMAT_VERSION + 1),
    "zero format_version": _set(("format_version",), 0),
    "string format_version": _set(("format_version",), "1"),
    "missing step": _delete(("step",)),
    "string step": _set(("step",), "100"),
    "float step": _set(("step",), 100.0),
    "bool step": _set(("step",), True),
    "negative step": _set(("step",), -1),
    "missing run_id": _delete(("run_id",)),
    "int run_id": _set(("run_id",), 5),
    "missing objects": _delete(("objects",)),
    "objects is a dict": _set(("objects",), {"checkpoint.ckpt": 1}),
    "object is a string": _set(("objects", 0), "checkpoint.ckpt"),
    "object without name": _delete(("objects", 0, "name")),
    "object without size": _delete(("objects", 0, "size")),
    "object without checksum": _delete(("objects", 0, "checksum")),
    "dotdot name": _set(("objects", 0, "name"), "../step-00000001/checkpoint.ckpt"),
    "absolute name": _set(("objects", 0, "name"), "/etc/passwd"),
    "url name": _set(("objects", 0, "name"), "s3://other-bucket/secret"),
    "empty name": _set(("objects", 0, "name"), ""),
    "null name": _set(("objects", 0, "name"), None),
    "manifest as object": _set(("objects", 0, "name"), MANIFEST_NAME),
    "string size": _set(("objects", 0, "size"), "1234"),
    "float size": _set(("objects", 0, "size"), 1234.0),
    "bool size": _set(("objects", 0, "size"), True),
    "negative size": _set(("objects", 0, "size"), -1),
    "absurd size": _set(("objects", 0, "size"), 1 << 60),
    "huge int size": _set(("objects", 0, "size"), 10**400),
    "checksum not a string": _set(("objects", 0, "checksum"), 1234),
    "unknown checksum algorithm": _set(("objects", 0, "checksum"), "md5:0badf00d"),
    "checksum not hex": _set(("objects", 0, "checksum"), "crc32:zzzzzzzz"),
    "duplicate names": _duplicate_first_object,
    "cut is a list": _set(("cut",), [1, 2]),
    "extra is a string": _set(("extra",), "x"),
    "committed_at is a string": _set(("committed_at",), "yesterday"),
    "committed_at is a bool": _set(("committed_at",), True),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_BODIES))
def test_hostile_or_malformed_body_is_a_manifest_error(case: str) -> None:
    body = _body()
    _HOSTILE_BODIES[case](body)
    with pytest.raises(ManifestError, match="where-marker"):
        Manifest.from_json(json.dumps(body), where="where-marker")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"not json",
        b"\xff\xfe\x00garbage",
        b"[]",
        b"null",
        b"42",
        b'"a string"',
        # Deep nesting makes the json module raise RecursionError, which is not a ValueError.
        b"[" * 200_000 + b"]" * 200_000,
        b'{"a": ' * 200_000 + b"1" + b"}" * 200_000,
    ],
    ids=["empty", "truncated", "text", "binary", "list", "null", "number", "string", "deep-list", "deep-dict"],
)
def test_corrupt_bytes_are_a_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


def test_truncated_manifest_is_a_manifest_error() -> None:
    data = _manifest().to_json()
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(ManifestError):
            Manifest.from_json(data[:cut])
