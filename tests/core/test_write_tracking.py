"""The exact guard with kernel write tracking (core/write_tracker.py): every write through the page tables between
the cut and the seal refuses the snapshot, whatever wrote it, and nothing else does.

On a kernel without asynchronous userfaultfd write protection the tracker is ``None`` and the guard fingerprints
(tests/core/test_proof_guard.py); the tests here that need the tracker skip there, and the fallback tests run
everywhere."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from lightning_async_ckpt.core import guard, write_tracker
from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.staging import BufferPool, StagingJob
from lightning_async_ckpt.core.write_tracker import PAGE, page_interior, tracker

PROVEN = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("test",))
needs_tracker = pytest.mark.skipif(
    tracker() is None, reason="this kernel has no asynchronous userfaultfd write protection with PAGEMAP_SCAN"
)
MB4 = (4 << 20) // 4  # float32 elements of a 4 MiB tensor


@pytest.fixture(autouse=True)
def _track_small_states(monkeypatch):
    # The guard tracks only cuts of at least 128 MB (below, the fingerprint is cheaper); these tests use 4 MB.
    monkeypatch.setattr(guard, "_TRACK_MIN_TOTAL", 0)


def _job(weight: torch.Tensor) -> tuple[CapturePlan, StagingJob]:
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = CapturePlan.build({"weight": model.weight.detach()}, modules=[model], optimizers=[opt], proof=PROVEN)
    assert plan.slots[0].fence == Fence.OPTIMIZER_STEP
    return plan, StagingJob(plan.slots, BufferPool(None).acquire(plan.slots), guard="full")


def _raw_write(weight: torch.Tensor, index: int, value: float) -> None:
    """A write no tensor operation sees: through a ctypes pointer (no version counter, no dispatcher)."""
    ctypes.c_float.from_address(weight.data_ptr() + 4 * index).value = value


@needs_tracker
@pytest.mark.parametrize("where", ["first_whole_page", "middle", "last_whole_page"])
def test_a_raw_write_between_cut_and_copy_is_refused_without_reading_the_bytes(where):
    weight = torch.randn(MB4)
    start, end = page_interior(weight.data_ptr(), weight.numel() * 4)
    offset = {"first_whole_page": start, "middle": (start + end) // 2, "last_whole_page": end - 4}[where]
    index = (offset - weight.data_ptr()) // 4
    for _ in range(5):
        _, job = _job(weight)
        job.copy_at_cut()
        assert job._guard.tracked_bytes == end - start  # tracked, not fingerprinted
        _raw_write(weight, index, 7.0)
        job.run()
        assert job.error is not None and "page written" in str(job.error)
        assert tracker().active == 0  # the protection is lifted after the seal


@needs_tracker
def test_numpy_and_data_writes_and_kernel_writes_are_refused():
    weight = torch.zeros(MB4)

    def numpy_view(w):
        w.numpy()[MB4 // 2] = 1.0

    def data_write(w):
        w.data[MB4 // 3] = 2.0

    def kernel_write(w):  # the kernel writes into the tensor on the process's behalf: readv from /dev/zero
        start, _ = page_interior(w.data_ptr(), w.numel() * 4)
        w.numpy().view(np.uint8)[start - w.data_ptr() + 5 * PAGE : start - w.data_ptr() + 6 * PAGE] = 9
        fd = os.open("/dev/zero", os.O_RDONLY)
        try:
            os.readv(fd, [memoryview((ctypes.c_char * PAGE).from_address(start + 5 * PAGE)).cast("B")])
        finally:
            os.close(fd)

    for write in (numpy_view, data_write, kernel_write):
        _, job = _job(weight)
        job.copy_at_cut()
        write(weight)
        job.run()
        assert job.error is not None, write.__name__
        weight.zero_()


def test_a_write_to_a_partial_page_is_refused_by_its_fingerprint():
    # The bytes before the first whole page and after the last are fingerprinted at the cut: still exact.
    for index in (0, MB4):  # the storage's first and last element
        _, job = _job(torch.zeros(MB4 + 1))
        base = job.slots[0].storage.data_ptr()
        start, end = page_interior(base, (MB4 + 1) * 4)
        job.copy_at_cut()
        ctypes.c_float.from_address(base + 4 * index).value = 3.0
        job.run()
        inside = start <= base + 4 * index < end
        expected = "page written" if inside and tracker() is not None else ("partial page", "checksum")
        assert job.error is not None and any(word in str(job.error) for word in np.atleast_1d(expected))


def test_unchanged_state_commits_and_the_writes_after_the_fence_do_not_count():
    weight = torch.randn(MB4)
    for _ in range(5):
        plan, job = _job(weight)
        expected = weight.clone()
        job.copy_at_cut()
        thread = threading.Thread(target=job.run, name="lightning_async_ckpt-test-stage")
        thread.start()
        job.wait(Fence.OPTIMIZER_STEP)  # the fence opens after the seal: the optimizer's step below is legitimate
        _raw_write(weight, MB4 // 2, 5.0)
        weight.mul_(0.5)
        thread.join()
        assert job.error is None
        assert torch.equal(plan.materialize(job.buffers)["weight"], expected)
        weight.copy_(expected)


@needs_tracker
def test_a_write_while_the_copy_runs_is_refused_gated():
    # The staging thread is held after its first chunk; the training side writes the last page meanwhile.
    weight = torch.randn(4 * MB4)
    _, job = _job(weight)
    copied_one, go_on = threading.Event(), threading.Event()
    original = np.copyto

    def gated_copyto(dst, src, *args, **kwargs):
        original(dst, src, *args, **kwargs)
        if threading.current_thread().name == "lightning_async_ckpt-test-stage" and not copied_one.is_set():
            copied_one.set()
            go_on.wait()

    job.copy_at_cut()
    np.copyto = gated_copyto
    try:
        thread = threading.Thread(target=job.run, name="lightning_async_ckpt-test-stage")
        thread.start()
        copied_one.wait()
        _raw_write(weight, 4 * MB4 - 2048, 1.5)
        go_on.set()
        thread.join()
    finally:
        np.copyto = original
    assert job.error is not None and "page written" in str(job.error)


@needs_tracker
def test_an_overlapping_second_session_is_fingerprinted_not_tracked():
    # Two guards over the same storage (two checkpointers of one model): the second cannot reset the first's
    # tracking, so it fingerprints; both still refuse a write.
    weight = torch.randn(MB4)
    _, first = _job(weight)
    _, second = _job(weight)
    first.copy_at_cut()
    second.copy_at_cut()
    assert first._guard.tracked_bytes > 0 and second._guard.tracked_bytes == 0
    weight.numpy()[MB4 // 2] = 4.0
    first.run()
    second.run()
    assert "page written" in str(first.error)
    assert "checksum" in str(second.error)
    assert tracker().active == 0


@needs_tracker
def test_a_failed_copy_lifts_the_protection():
    weight = torch.randn(MB4)
    _, job = _job(weight)
    job.abandon = threading.Event()
    job.copy_at_cut()
    assert tracker().active == 1
    job.abandon.set()
    job.run()
    assert job.error is not None and tracker().active == 0


def test_without_the_kernel_feature_the_guard_fingerprints(monkeypatch):
    monkeypatch.setenv("LAC_WRITE_TRACKING", "0")
    monkeypatch.setattr(write_tracker, "_checked_pid", None)
    monkeypatch.setattr(write_tracker, "_tracker", None)
    assert tracker() is None
    weight = torch.randn(MB4)
    _, job = _job(weight)
    job.copy_at_cut()
    assert job._guard.tracked_bytes == 0
    weight.numpy()[MB4 // 2] = 4.0
    job.run()
    assert job.error is not None and "checksum" in str(job.error)
    monkeypatch.setattr(write_tracker, "_checked_pid", None)  # the next use re-detects


_FORK_CHECK = """
import mmap, os
from lightning_async_ckpt.core.write_tracker import PAGE, tracker

parent = tracker()
area = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
import ctypes
view = (ctypes.c_char * (8 * PAGE)).from_buffer(area); base = ctypes.addressof(view); del view
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    child = tracker()
    ok = child is not None and child is not parent and child.pid == os.getpid()
    ok = ok and child.protect(base, base + 8 * PAGE) and not child.written(base, base + 8 * PAGE)
    area[3 * PAGE] = 1
    ok = ok and child.written(base, base + 8 * PAGE)
    child.release(base, base + 8 * PAGE)
    os.write(write, b"1" if ok else b"0")
    os._exit(0)
os.waitpid(pid, 0)
print("child", os.read(read, 1).decode(), "parent", int(parent.pid == os.getpid() and parent.active == 0))
"""


@needs_tracker
def test_a_forked_child_gets_its_own_tracker():
    # A child has its own page tables: the parent's descriptors would scan the parent. Forked from a fresh
    # single-threaded interpreter (forking this multi-threaded test process could inherit a held lock).
    out = subprocess.run([sys.executable, "-c", _FORK_CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["child", "1", "parent", "1"], out.stderr


@needs_tracker
def test_a_file_backed_storage_is_fingerprinted_and_a_write_to_the_file_is_refused(tmp_path):
    # A shared file mapping changes when the file is written (another process, os.pwrite): no write goes through
    # this process's page tables, so the tracker must not vouch for it; the fingerprint catches the change.
    path = tmp_path / "weights.bin"
    path.write_bytes(np.zeros(MB4, dtype=np.float32).tobytes())
    weight = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+", shape=(MB4,)))
    _, job = _job(weight)
    job.copy_at_cut()
    assert job._guard.tracked_bytes == 0
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, np.float32(9.0).tobytes(), 4 * (MB4 // 2))
    finally:
        os.close(fd)
    job.run()
    assert job.error is not None and "checksum" in str(job.error)


@needs_tracker
@pytest.mark.skipif(platform.machine() != "x86_64", reason="io_uring_setup's syscall number is x86-64's here")
def test_an_io_uring_in_the_process_turns_tracking_off():
    # A ring's registered buffers are written by the kernel through its own mapping (no fault, the protection bit
    # stays): with a ring open every storage is fingerprinted.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = (ctypes.c_uint8 * 120)()
    ring = libc.syscall(425, 4, params)  # io_uring_setup
    if ring < 0:
        pytest.skip(f"io_uring_setup failed: errno {ctypes.get_errno()}")
    try:
        weight = torch.zeros(MB4)
        _, job = _job(weight)
        job.copy_at_cut()
        assert job._guard.tracked_bytes == 0
        weight.numpy()[MB4 // 2] = 1.0
        job.run()
        assert job.error is not None and "checksum" in str(job.error)
    finally:
        os.close(ring)
    _, job = _job(torch.zeros(MB4))
    job.copy_at_cut()
    assert job._guard.tracked_bytes > 0  # the ring closed: tracked again
    job.run()


_FOREIGN_UFFD = """
import ctypes, fcntl, os, struct, sys, threading
import torch
sys.path.insert(0, os.getcwd())
from tests.core.test_write_tracking import MB4, _job
from lightning_async_ckpt.core import guard
from lightning_async_ckpt.core.write_tracker import page_interior

guard._TRACK_MIN_TOTAL = 0

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
other = libc.syscall(323, os.O_CLOEXEC | 1)
fcntl.ioctl(other, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))  # synchronous write protection
weight = torch.ones(MB4)
start, end = page_interior(weight.data_ptr(), weight.numel() * 4)
assert libc.ioctl(other, 0xC020AA00, (ctypes.c_uint64 * 4)(start, end - start, 2, 0)) == 0
_, job = _job(weight)
job.copy_at_cut()
done = threading.Event()
threading.Thread(target=lambda: (weight.data.__setitem__(MB4 // 2, 2.0), done.set()), daemon=True).start()
if not done.wait(60):
    print("HANG"); sys.stdout.flush(); os._exit(1)
job.run()
print("tracked", job._guard.tracked_bytes, "refused", "checksum" in str(job.error))
"""


@needs_tracker
def test_memory_another_userfaultfd_registered_is_fingerprinted_and_writes_never_block():
    # Registering first (EBUSY on another's range) instead of protecting first: protecting memory another
    # synchronous userfaultfd owns would block the next write forever.
    out = subprocess.run([sys.executable, "-c", _FOREIGN_UFFD], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-4:] == ["tracked", "0", "refused", "True"], out.stdout + out.stderr


_FORK_RELEASE = """
import os, sys
import torch
sys.path.insert(0, os.getcwd())
from tests.core.test_write_tracking import MB4, _job
from lightning_async_ckpt.core import guard

guard._TRACK_MIN_TOTAL = 0
weight = torch.randn(MB4)
_, job = _job(weight)
job.copy_at_cut()
pid = os.fork()
if pid == 0:
    job._guard.release()  # the child drops its copy: must not touch the parent's protection
    del job
    os._exit(0)
os.waitpid(pid, 0)
job.run()
print("committed", job.error is None)
"""


@needs_tracker
def test_a_forked_child_cannot_release_or_scan_the_parents_tracking():
    out = subprocess.run([sys.executable, "-c", _FORK_RELEASE], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["committed", "True"], out.stdout + out.stderr


@needs_tracker
def test_released_ranges_are_unregistered_so_mappings_do_not_pile_up():
    def mappings() -> int:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)

    tensors = [torch.randn(300 << 8) for _ in range(200)]  # 300 KiB each: heap or small mappings
    before = mappings()
    for _ in range(3):
        _, jobs = zip(*[_job(t) for t in tensors], strict=True)
        for job in jobs:
            job.copy_at_cut()
        assert sum(job._guard.tracked_bytes > 0 for job in jobs) > 100
        for job in jobs:
            job.run()
            assert job.error is None
    assert mappings() - before < 20


def test_a_small_cut_is_fingerprinted(monkeypatch):
    monkeypatch.setattr(guard, "_TRACK_MIN_TOTAL", 128 << 20)
    _, job = _job(torch.randn(MB4))
    job.copy_at_cut()
    assert job._guard.tracked_bytes == 0
    job.run()
    assert job.error is None


@needs_tracker
@pytest.mark.parametrize("repeat", range(3))
def test_every_range_is_protected_and_written_sees_exactly_the_pages_written(repeat):
    # Several ranges protected by one protect_all (one PAGEMAP_SCAN walk each): every range is tracked when it
    # returns, and written() sees exactly the ranges written since, at their first, middle or last page.
    tensors = [torch.zeros(MB4 * (1 + i % 3)) for i in range(6)]
    spans = [page_interior(t.data_ptr(), t.numel() * 4) for t in tensors]
    track = tracker()
    assert all(track.protect_all(spans))
    try:
        written = {1, 4} if repeat % 2 else {0, 5}
        for i in written:  # the first, a middle or the last whole page
            address = (spans[i][0], (spans[i][0] + spans[i][1]) // 2 // 4 * 4, spans[i][1] - 4)[repeat]
            ctypes.c_float.from_address(address).value = 1.0
        assert {i for i, span in enumerate(spans) if track.written(*span)} == written
    finally:
        for span in spans:
            track.release(*span)
    assert track.active == 0


@needs_tracker
def test_pages_never_touched_are_protected_too_and_reading_them_is_not_a_write():
    # Fresh anonymous memory: half its pages populated, half never touched (no page-table entry, some with no page
    # table at all). The protection covers all of them: reading an untouched page is no write, writing one is.
    import mmap

    pages = 1024  # 4 MiB: spans whole page tables
    area = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = (ctypes.c_char * (pages * PAGE)).from_buffer(area)
        base = ctypes.addressof(view)
        del view
        for i in range(0, pages // 2, 2):
            area[i * PAGE] = 1
        track = tracker()
        span = (base, base + pages * PAGE)
        assert track.protect(*span)
        try:
            assert not track.written(*span)
            assert area[3 * PAGE] == 0 and area[(pages - 3) * PAGE] == 0  # reads of untouched pages
            assert not track.written(*span)
            area[(pages - 5) * PAGE + 9] = 2  # a write to a page with no page table before the cut
            assert track.written(*span)
        finally:
            track.release(*span)
    finally:
        area.close()


@needs_tracker
def test_a_range_that_could_not_be_protected_is_reported_not_tracked():
    from lightning_async_ckpt.core import uffd_calls

    tensors = [torch.zeros(MB4 * 2) for _ in range(3)]
    spans = [page_interior(t.data_ptr(), t.numel() * 4) for t in tensors]
    track = tracker()
    for span in spans[:2]:
        assert track._register(*span)
    try:
        # The third was never registered: the scan refuses it (PM_SCAN_CHECK_WPASYNC), the others are protected.
        failed = uffd_calls.write_protect(track._pagemap, spans)
        assert failed == {spans[2]}
    finally:
        for span in spans[:2]:
            track._disarm(*span)
