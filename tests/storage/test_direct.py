"""The pipelined ``O_DIRECT`` file: exact bytes for every size and write pattern, and aligned buffers reused
between files (a fresh mapping costs page faults on first touch) without stale bytes leaking into a shorter file."""

from __future__ import annotations

import errno
import mmap
import os
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.storage.direct import DIRECT_ALIGN, DirectFile, cached_buffer_bytes, release_buffers
from lightning_async_ckpt.storage.store import CheckpointStore

BUF = 16 * DIRECT_ALIGN  # small buffers: every path (full buffers, cycling, the unaligned tail) in a few KiB


def _open(path: Path, buffer_bytes: int = BUF) -> DirectFile:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip("this filesystem has no O_DIRECT")
        raise
    return DirectFile(fd, buffer_bytes)


def _write(path: Path, data: bytes, chunk: int, buffer_bytes: int = BUF) -> None:
    f = _open(path, buffer_bytes)
    for pos in range(0, len(data), chunk):
        f.write(data[pos : pos + chunk])
    f.flush()
    f.close()


@pytest.fixture(autouse=True)
def _empty_cache():
    release_buffers()
    yield
    release_buffers()


@pytest.mark.parametrize("size", [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, BUF, 3 * BUF + 7, 7 * BUF])
@pytest.mark.parametrize("chunk", [1000, BUF, 200_000])
def test_every_size_and_write_pattern_lands_byte_exact(tmp_path: Path, size: int, chunk: int) -> None:
    data = os.urandom(size)
    _write(tmp_path / "f", data, chunk)
    assert (tmp_path / "f").read_bytes() == data


def test_buffers_are_kept_between_files_and_a_shorter_file_gets_no_stale_bytes(tmp_path: Path) -> None:
    long = os.urandom(5 * BUF + 123)
    _write(tmp_path / "a", long, chunk=BUF // 3)
    assert cached_buffer_bytes() == 3 * BUF  # the three buffers of "a" wait for the next file

    f = _open(tmp_path / "b")
    short = b"\x01" * (BUF // 2 + 5)
    f.write(short)
    assert cached_buffer_bytes() == 2 * BUF  # "b" took one of them: reused, not a fresh mapping
    f.flush()
    f.close()
    assert (tmp_path / "b").read_bytes() == short
    assert (tmp_path / "a").read_bytes() == long
    assert cached_buffer_bytes() == 3 * BUF  # never more than one file's worth


def test_release_unmaps_the_kept_buffers_and_later_files_still_write(tmp_path: Path) -> None:
    _write(tmp_path / "a", os.urandom(2 * BUF), chunk=BUF)
    assert cached_buffer_bytes() > 0
    release_buffers()
    assert cached_buffer_bytes() == 0
    data = os.urandom(BUF + 9)
    _write(tmp_path / "b", data, chunk=4096)
    assert (tmp_path / "b").read_bytes() == data


def test_closing_a_checkpointer_releases_the_kept_buffers(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    state = {"w": torch.randn(256, 256)}
    with AsyncCheckpointer(store) as ckpt:
        ckpt.save(1, state, defer=False).result(timeout=60)
        ckpt.drain()
        if cached_buffer_bytes() == 0:
            pytest.skip("the store did not write through O_DIRECT here")
    assert cached_buffer_bytes() == 0
    with store.open(1, "checkpoint.ckpt") as f:
        loaded = torch.load(f, weights_only=True)
    torch.testing.assert_close(loaded["w"], state["w"], rtol=0, atol=0)


def _aligned(data: bytes) -> memoryview:
    """``data`` in a page-aligned private mapping (as the staging pool's buffers are)."""
    region = mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region[:] = data
    return memoryview(region)


@pytest.mark.parametrize("tail", [0, 100])
def test_aligned_spans_are_written_in_place_in_order_with_the_copied_bytes(tmp_path: Path, tail: int) -> None:
    header, big, small = os.urandom(DIRECT_ALIGN), os.urandom(2 << 20), os.urandom(3000)
    first, unaligned = big + os.urandom(tail), os.urandom((1 << 20) + 5)
    f = _open(tmp_path / "f")
    f.write(header)  # copied: small
    f.write(_aligned(first))  # aligned memory at an aligned offset: in place, its unaligned tail copied
    f.write(small)  # the offset is unaligned from here (with a tail): later spans are copied
    f.write(_aligned(big))
    f.write(unaligned)
    f.flush()
    f.close()
    assert (tmp_path / "f").read_bytes() == header + first + small + big + unaligned
    assert f.in_place_bytes == len(big)  # only the first span met both alignments


def test_a_checkpoint_of_large_storages_is_laid_out_for_in_place_writes_and_loads_back(tmp_path: Path) -> None:
    # The default serializer aligns each storage's bytes to the direct-I/O block when the padding is cheap, and the
    # staging pool's large buffers are page-aligned: the staged storages reach the disk without the aligned copy.
    state = {"w": torch.randn(1 << 20), "b": torch.randn(3 << 18), "n": torch.arange(10)}
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ckpt = AsyncCheckpointer(store)
    try:
        ckpt.save(1, state).committed.result()
    finally:
        ckpt.close()
    path = tmp_path / "ckpt" / store.generation_path(1).rsplit("/", 1)[-1] / "checkpoint.ckpt"
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        offsets = {  # where each record's bytes start: after its local header, name and extra field (the padding)
            info.filename: info.header_offset
            + 30
            + int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
            + int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
            for info in archive.infolist()
            if "/data/" in info.filename
        }
    assert len(offsets) == 3 and all(offset % DIRECT_ALIGN == 0 for offset in offsets.values()), offsets
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
