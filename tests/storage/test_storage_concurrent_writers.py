"""Concurrent writers in one process (issue 27 item 8): eight threads, eight generations, one local store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lightning_async_ckpt.storage.direct import release_buffers
from lightning_async_ckpt.storage.store import CheckpointStore

THREADS = 8


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "store-per-thread"])
def test_eight_threads_each_commit_a_generation_into_one_local_store(tmp_path: Path, shared: bool) -> None:
    """Every thread holds an open object (an aligned write buffer) until all do, then all close at once.

    With more buffers in flight than the process keeps between files, closing the extra ones raised
    ``BufferError: cannot close exported pointers exist`` (the caller's list still referenced their views).
    """
    release_buffers()
    one = CheckpointStore(str(tmp_path)) if shared else None
    all_open = threading.Barrier(THREADS, timeout=30)
    errors: list[BaseException] = []

    def save(step: int) -> None:
        try:
            store = one or CheckpointStore(str(tmp_path))
            writer = store.begin(step)
            stream = writer.open("checkpoint.ckpt")
            stream.write(bytes([step]) * (1 << 20))
            all_open.wait()  # every thread has taken a buffer before any gives one back
            stream.close()
            writer.commit()
        except BaseException as exc:  # noqa: BLE001 - collected and raised on the test thread
            errors.append(exc)
            all_open.abort()

    threads = [threading.Thread(target=save, args=(step,), name=f"test-writer-{step}") for step in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    release_buffers()
    assert not errors, errors
    reader = CheckpointStore(str(tmp_path))
    assert [g.step for g in reader.generations()] == list(range(THREADS))
    for step in range(THREADS):
        assert reader.verify(step).ok
        with reader.open(step, "checkpoint.ckpt") as f:
            assert f.read() == bytes([step]) * (1 << 20)
