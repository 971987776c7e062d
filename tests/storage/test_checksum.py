"""Checksums: crc32c is the default where installed, and every algorithm is verified on read."""

from __future__ import annotations

import zlib

import crc32c
import pytest

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.store import CheckpointStore


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("crc32c", lambda b: f"crc32c:{crc32c.crc32c(b):08x}"),
        ("crc32", lambda b: f"crc32:{zlib.crc32(b):08x}"),
    ],
)
def test_checksum_algorithms_match_reference_and_verify(tmp_path, algorithm, expected):
    data = bytes(range(256)) * 4099
    store = CheckpointStore(str(tmp_path), checksum=algorithm)
    writer = store.begin(1)
    with writer.open("blob") as stream:
        for i in range(0, len(data), 10_000):
            stream.write(data[i : i + 10_000])
    writer.commit()
    assert store.manifest(1).objects[0].checksum == expected(data)
    assert store.verify(1).ok


def test_default_is_crc32c_when_the_package_is_installed(tmp_path):
    assert CheckpointStore(str(tmp_path)).checksum == "crc32c"


def test_unknown_checksum_names_the_parameter(tmp_path):
    with pytest.raises(ConfigError, match="checksum"):
        CheckpointStore(str(tmp_path), checksum="md5")
