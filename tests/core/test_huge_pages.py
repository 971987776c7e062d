"""Opt-in huge pages (``CheckpointOptions.huge_pages``): deferred host storages are backed by 2 MiB pages after
their first save, and the exact guard still refuses a write between the cut and the copy over them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.core.write_tracker import tracker
from lightning_async_ckpt.errors import ConfigError, TornSnapshotError
from tests.helpers.staging_jobs import deferred_job

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="transparent huge pages are off or absent",
)


def _job(weight: torch.nn.Parameter) -> StagingJob:
    job = deferred_job(weight)
    job.huge_pages = True
    return job


def _anon_huge_kb(address: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_deferred_storages_are_backed_by_huge_pages_and_the_guard_still_sees_a_write() -> None:
    weight = torch.nn.Parameter(torch.randn(136 << 20 >> 2))  # 136 MiB: write-tracked (128 MiB and more)
    first = _job(weight)
    first.copy_at_cut()
    first.run()
    assert first.error is None
    assert first.huge_page_thread is not None  # collapsed beside the staging thread, which goes on
    first.huge_page_thread.join()
    if first.huge_page_thread.collapsed == 0:
        pytest.skip("this kernel cannot collapse pages into huge pages (MADV_COLLAPSE, Linux 6.1+)")
    middle = weight.data_ptr() + weight.nbytes // 2
    assert _anon_huge_kb(middle) >= 2048

    clean = _job(weight)  # a later save over the huge pages: no write, an exact copy
    clean.copy_at_cut()
    clean.run()
    assert clean.error is None
    assert torch.equal(clean.buffers[0].view(torch.float32), weight.detach())

    torn = _job(weight)
    torn.copy_at_cut()
    weight.data[weight.numel() // 2] += 1.0  # through .data: no version counter moves; only the pages say so
    torn.run()
    assert isinstance(torn.error, TornSnapshotError)
    if tracker() is not None:
        assert "page written" in str(torn.error)


def test_huge_pages_is_a_bool_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="huge_pages"):
        AsyncCheckpointer(str(tmp_path), huge_pages="yes")


def test_a_span_the_kernel_would_not_collapse_is_tried_again_later() -> None:
    from lightning_async_ckpt.core.huge_pages import advise_huge_pages
    from lightning_async_ckpt.core.write_tracker import page_interior

    track = tracker()
    if track is None:
        pytest.skip("this kernel cannot track writes")
    probe = torch.randn(16 << 20 >> 2)
    if advise_huge_pages([(probe.data_ptr(), probe.nbytes)]) == 0:
        pytest.skip("this kernel cannot collapse pages into huge pages (MADV_COLLAPSE, Linux 6.1+)")
    weight = torch.randn(16 << 20 >> 2)
    span = (weight.data_ptr(), weight.nbytes)
    start, end = page_interior(*span)
    assert track.protect(start, end)  # armed, as a later cut's protection would be: the kernel refuses a collapse
    try:
        refused = advise_huge_pages([span])
    finally:
        track.release(start, end)
    if refused:
        pytest.skip("this kernel collapsed write-protected pages")
    assert advise_huge_pages([span]) > 0  # not marked done by the refusal: collapsed now
    assert _anon_huge_kb(weight.data_ptr() + weight.nbytes // 2) >= 2048
