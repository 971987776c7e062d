"""The pipelined ``O_DIRECT`` file: exact bytes for every size and write pattern, and aligned buffers reused
between files (a fresh mapping costs page faults on first touch) without stale bytes leaking into a shorter file."""

from __future__ import annotations

import errno
import os
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
