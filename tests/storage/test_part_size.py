"""Multipart part sizes chosen from the object's size: fewer requests for large objects, S3's limits kept.

The S3 test counts the moto server's ``UploadPart`` requests of a sharded save whose data file's size the writer
knows from DCP's plan.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_async_ckpt.storage.backend import DEFAULT_PART_SIZE, MAX_PART_SIZE, part_size
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.s3_requests import s3_requests

MIB, GIB, TIB = 1 << 20, 1 << 30, 1 << 40
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_part_size_follows_the_object_size_within_bounds() -> None:
    assert part_size(None) == DEFAULT_PART_SIZE  # unknown size: the default
    assert part_size(100 * MIB) == DEFAULT_PART_SIZE  # small objects: unchanged
    assert part_size(8 * GIB) == 128 * MIB  # 64 parts instead of 256
    assert part_size(100 * GIB) == MAX_PART_SIZE  # bounded: one part is buffered per open stream
    # Past 2.4 TiB only S3's 10,000-part limit raises it (32 MiB parts could not upload more than 312 GiB).
    for size in (3 * TIB, 5 * TIB - 1):
        assert part_size(size) * 10_000 >= size and part_size(size) % MIB == 0
    assert part_size(10 * MIB, 5 * MIB) == 5 * MIB and part_size(10 * MIB, 1) == 5 * MIB  # S3's minimum
    assert part_size(100 * GIB, 512 * MIB) == 512 * MIB  # a larger configured block stays


def test_a_sharded_data_file_of_known_size_is_uploaded_in_fewer_parts(s3_uri: tuple[str, dict[str, Any]]) -> None:
    pytest.importorskip("s3fs")
    from lightning_async_ckpt.sharded import ShardedCheckpointer

    uri, options = s3_uri
    store = CheckpointStore(uri, options, block_size=5 * MIB)  # 5 MiB parts: a 23 MiB file took 5 UploadParts
    store.backend.parts_per_object = 2  # (64 by default: the same rule, scaled to a test-sized object)
    # 46 tensors of 0.5 MiB: DCP writes each as one write; s3fs uploads a part once a block is buffered.
    state = {f"w{i}": torch.full((MIB // 8,), float(i)) for i in range(46)}
    with s3_requests() as log, ShardedCheckpointer(store) as ckpt:
        ckpt.save(1, state).result(timeout=120)
    parts = [t for m, t, _ in log.requests if m == "PUT" and "partNumber=" in t and ".distcp" in t]
    assert len(parts) == 2, parts  # 12 MiB parts, from the plan's 23 MiB
    assert CheckpointStore(uri, options, check_writable=False).verify(1).ok
