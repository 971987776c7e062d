"""Checksums: crc32c is the default where installed, and every algorithm is verified on read."""

from __future__ import annotations

import zlib

import pytest

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.store import CheckpointStore


def _crc32c_reference(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected 0x82F63B78) bit by bit, independent of either package."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_the_reference_is_crc32c():
    assert _crc32c_reference(b"123456789") == 0xE3069283  # the check value of CRC-32C


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("crc32c", lambda b: f"crc32c:{_crc32c_reference(b):08x}"),
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


def test_google_crc32c_takes_views_of_staging_buffers():
    # The declared dependency's C extension takes only bytes; the store hands it memoryviews.
    google_crc32c = pytest.importorskip("google_crc32c")
    from lightning_async_ckpt.storage.crc import _GoogleCrc32c

    data = bytearray(range(256)) * 8
    adapter = _GoogleCrc32c(google_crc32c)
    value = adapter.crc32c(memoryview(data)[:1000])
    assert adapter.crc32c(memoryview(data)[1000:], value) == _crc32c_reference(bytes(data))


def test_google_crc32c_library_reads_buffers_in_place():
    # google-crc32c's own C library, called without a copy: views, offsets, read-only and non-contiguous inputs.
    google_crc32c = pytest.importorskip("google_crc32c")
    import numpy as np

    from lightning_async_ckpt.storage.crc import _bundled_crc32c

    lib = _bundled_crc32c(google_crc32c)
    if lib is None:
        pytest.skip("this google-crc32c install ships no C library (pure-Python build)")
    data = bytearray(range(256)) * 8
    value = lib.crc32c(memoryview(data)[:1000])
    assert lib.crc32c(memoryview(data)[1000:], value) == _crc32c_reference(bytes(data))
    assert lib.crc32c(bytes(data)) == _crc32c_reference(bytes(data))
    assert lib.crc32c(b"", 7) == 7
    strided = np.arange(64, dtype=np.uint8)[::2]
    assert lib.crc32c(memoryview(strided)) == _crc32c_reference(strided.tobytes())
    assert lib.crc32c(np.arange(8, dtype=np.float32)) == _crc32c_reference(np.arange(8, dtype=np.float32).tobytes())


def test_in_place_crc32c_is_offered_by_the_declared_dependency():
    # The staging copy checksums what it just copied only with an implementation that needs no copy of its own.
    pytest.importorskip("google_crc32c")
    from lightning_async_ckpt.storage.crc import _GoogleCrc32c, crc32c_in_place, crc32c_module

    assert crc32c_module() is crc32c_module()  # looked up once
    in_place = crc32c_in_place()
    assert (in_place is None) == isinstance(crc32c_module(), _GoogleCrc32c)
    if in_place is not None:
        assert in_place.crc32c(memoryview(bytearray(b"123456789"))) == 0xE3069283
