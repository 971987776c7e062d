"""The write tracker reads ``/proc/self/maps`` at a cut only for memory it has not accepted before: a storage it
protected at an earlier cut and that is still alive cannot have been mapped again (the next cut skips the read),
and a freed one is checked again even where a new storage lands at the same address."""

from __future__ import annotations

import gc

import pytest
import torch

from lightning_async_ckpt.core import write_tracker
from lightning_async_ckpt.core.staging import StagingJob
from tests.helpers.staging_jobs import deferred_job

pytestmark = pytest.mark.skipif(write_tracker.tracker() is None, reason="this kernel cannot track writes")


def _save(weight: torch.nn.Parameter) -> StagingJob:
    job = deferred_job(weight)
    job.copy_at_cut()
    job.run()
    assert job.error is None
    return job


def test_maps_are_read_once_per_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    real = write_tracker._anonymous_private_spans

    def counted() -> list[tuple[int, int]]:
        reads.append(1)
        return real()

    monkeypatch.setattr(write_tracker, "_anonymous_private_spans", counted)
    weight = torch.nn.Parameter(torch.randn(136 << 20 >> 2))  # write-tracked: 128 MiB and more
    _save(weight)
    assert len(reads) == 1
    _save(weight)
    _save(weight)
    assert len(reads) == 1  # the same live storage: accepted before, not read again

    address = weight.data_ptr()
    del weight
    gc.collect()
    again = torch.nn.Parameter(torch.randn(136 << 20 >> 2))  # often at the same address (glibc's mmap reuse)
    _save(again)
    assert len(reads) == 2, f"a new allocation (same address: {again.data_ptr() == address}) was not checked"


def test_a_write_is_still_refused_at_a_cut_that_skipped_the_read() -> None:
    weight = torch.nn.Parameter(torch.randn(136 << 20 >> 2))
    _save(weight)
    job = deferred_job(weight)
    job.copy_at_cut()
    weight.data[weight.numel() // 2] += 1.0  # through .data: only the page tables see it
    job.run()
    assert job.error is not None and "page written" in str(job.error)
