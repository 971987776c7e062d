"""One memory pass in the background: the staging copy checksums each block while it is still in the cache, and
the upload and the exact guard use those checksums instead of reading the staged bytes again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.fingerprint import FINGERPRINT_CHUNK, fingerprint
from lightning_async_ckpt.core.staging import BufferPool, StagingJob
from lightning_async_ckpt.errors import TornSnapshotError
from lightning_async_ckpt.storage.crc import crc32c_in_place
from lightning_async_ckpt.storage.io import Checksum, crc32c_combine
from lightning_async_ckpt.storage.store import CheckpointStore

# An implementation that reads buffers in place: the crc32c package, or google-crc32c's library (a dependency).
crc32c = crc32c_in_place()
pytestmark = pytest.mark.skipif(crc32c is None, reason="no CRC-32C implementation that reads in place")

DEFER = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("test",))


@pytest.mark.parametrize(
    ("first", "second"), [(0, 0), (0, 7), (7, 0), (1, 1), (4096, 3), (123_457, 1_000_003), (3, 1 << 20)]
)
def test_crc32c_combine_is_the_crc_of_the_concatenation(first: int, second: int) -> None:
    a, b = os.urandom(first), os.urandom(second)
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), second) == crc32c.crc32c(a + b)


def _job(weight: torch.Tensor) -> tuple[StagingJob, CapturePlan]:
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight)
    opt = torch.optim.SGD([module.weight], lr=0.1)
    plan = CapturePlan.build({"weight": module.weight}, modules=[module], optimizers=[opt], proof=DEFER)
    return StagingJob(plan.slots, BufferPool(None).acquire(plan.slots), guard=True), plan


def test_the_staging_copy_checksums_each_buffer_as_the_guard_and_the_upload_would() -> None:
    # Two and a half fingerprint chunks and an odd tail: every chunk boundary and a partial last chunk.
    weight = torch.randn((2 * FINGERPRINT_CHUNK + FINGERPRINT_CHUNK // 2 + 12) // 4)
    job, plan = _job(weight)
    job.copy_at_cut()
    job.run()
    assert job.error is None
    (slot,) = plan.slots
    buf = job.buffers[slot.index]
    assert job.staged_sums[slot.index] == fingerprint(buf)
    assert job.staged_checksums() == {buf.data_ptr(): crc32c.crc32c(buf.numpy())}


def test_the_guard_still_refuses_a_write_no_version_counter_saw_before_the_copy() -> None:
    weight = torch.randn(3 * FINGERPRINT_CHUNK // 4)
    job, _ = _job(weight)
    job.copy_at_cut()
    weight.data[-5:] += 1.0  # through .data: the parameter's version counter does not move
    job.run()
    assert isinstance(job.error, TornSnapshotError)
    assert "checksum" in str(job.error)


def test_the_upload_does_not_read_the_staged_bytes_again_to_checksum_them(tmp_path: Path, monkeypatch) -> None:
    read: list[int] = []
    update = Checksum.update

    def counting(self: Checksum, data: bytes | memoryview) -> None:  # the real update, counted
        read.append(len(data))
        update(self, data)

    monkeypatch.setattr(Checksum, "update", counting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    ckpt = AsyncCheckpointer(store).attach(model, opt)  # its fences: the parameters are staged in the background
    handle = ckpt.save(1, {"model": model.state_dict()}, modules=[model], optimizers=[opt])
    handle.committed.result()
    ckpt.close()
    (entry,) = [o for o in store.manifest(1).objects if o.size > 1 << 20]
    deferred = sum(p.numel() * 4 for p in model.parameters())
    assert entry.checksum.startswith("crc32c:")
    assert sum(read) <= entry.size - deferred  # the deferred buffers' bytes were never read to checksum them
    assert store.verify(1).ok  # and the recorded checksum is the one of the bytes on disk
