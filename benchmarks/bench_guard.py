"""What exactness costs at the cut on CPU: the guard's modes against copying at the cut, side by side in one run.

For each size (one fp32 tensor of 16 MB to 1 GB, the deferred state of a checkpoint), on the training thread:

* ``memcpy floor``: ``np.copyto`` into a preallocated buffer (one core, what any copy at the cut costs at least);
* ``copy at cut``: the engine's copy of a copy-at-cut storage (``buf.copy_``, torch's threads);
* ``exact, tracked``: ``CutGuard.record`` in the default mode where the kernel tracks writes
  (``core/write_tracker.py``: the whole pages write-protected, only the partial pages fingerprinted), and on the
  staging thread its seal (the kernel's scan of written pages, then lifting the protection);
* ``exact, fingerprint``: ``CutGuard.record`` in the default mode without write tracking (CRC-32C of every byte,
  chunks spread over threads), what the guard does where the kernel cannot track writes;
* ``sample``: ``CutGuard.record`` in the opt-in sampled mode (64 bytes per storage);

and on the staging thread, after the copy landed, the fingerprint's check of the staged copy (``CutGuard.check``).
Each figure is the best of ``--repeats``; the ratios put the exact cut next to the copy it replaces. Run it with
``THP_MEM_ALLOC_ENABLE=1`` to see torch's CPU allocator back large tensors with transparent huge pages (the
tracked cut then walks 2 MiB entries). Prints; asserts nothing.

Usage::

    python benchmarks/bench_guard.py                  # 16, 64, 256, 1024 MB
    python benchmarks/bench_guard.py --sizes-mb 64 256 --repeats 5
    python benchmarks/bench_guard.py --arming         # how the tracked cut arms: the two kernel calls side by side

``--arming`` times only the write protection of freshly written pages (every page written since the last cut, as
after an optimizer step), two ways in turn: ``UFFDIO_WRITEPROTECT`` (the ``userfaultfd`` call) and ``PAGEMAP_SCAN``
with ``PM_SCAN_WP_MATCHING`` (what the tracker uses), each also split over two threads.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from lightning_async_ckpt.core import guard as guard_module
from lightning_async_ckpt.core import uffd_calls
from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence
from lightning_async_ckpt.core.guard import CutGuard, GuardMode
from lightning_async_ckpt.core.write_tracker import page_interior, tracker

_UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arming", action="store_true", help="compare the two ways to write-protect pages")
    args = parser.parse_args()
    print(
        f"# {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, numpy {np.__version__}, "
        f"torch threads {torch.get_num_threads()}, kernel {platform.release()}, write tracking "
        f"{'available' if tracker() is not None else 'NOT available'}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r}"
    )
    header = (
        f"{'MB':>6} {'memcpy floor':>13} {'copy at cut':>12} {'tracked cut':>12} {'seal (bg)':>10} "
        f"{'fingerprint':>12} {'sample':>9} {'check (bg)':>11} {'tracked/copy':>13} {'fp/copy':>8}"
    )
    if args.arming:
        print(f"{'MB':>6} {'UFFDIO_WRITEPROTECT':>20} {'split in two':>13} {'PAGEMAP_SCAN':>13} {'split in two':>13}")
        for mb in args.sizes_mb:
            print(f"{mb:>6} " + " ".join(f"{t * 1e3:>10.2f} ms" for t in _arming(mb, args.repeats)))
        return
    print(header)
    proof = DeferralProof(fences={Category.PARAMETER: Fence.OPTIMIZER_STEP}, rules=("bench",))
    for mb in args.sizes_mb:
        print(_row(mb, proof, args.repeats))


def _row(mb: int, proof: DeferralProof, repeats: int) -> str:
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn((mb << 20) // 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = CapturePlan.build({"w": model.weight.detach()}, modules=[model], optimizers=[opt], proof=proof)
    src = model.weight.detach().view(torch.uint8).view(-1)
    buf = torch.empty_like(src)
    floor = _best(lambda: np.copyto(buf.numpy(), src.numpy()), repeats)
    copy = _best(lambda: buf.copy_(src), repeats)
    total = guard_module._TRACK_MIN_TOTAL
    guard_module._TRACK_MIN_TOTAL = 0  # the tracked columns at every size (the guard tracks from 128 MB on)
    try:
        tracked = _best_tracked(plan, repeats)
        seal = _best_seal(plan, repeats)
    finally:
        guard_module._TRACK_MIN_TOTAL = total
    limit = guard_module._TRACK_MIN_BYTES
    guard_module._TRACK_MIN_BYTES = 1 << 62  # every storage fingerprinted: the guard without write tracking
    try:
        full = CutGuard(plan.slots, GuardMode.FULL)
        exact = _best(full.record, repeats)
        check = _best(lambda: full.check([buf]), repeats)
    finally:
        guard_module._TRACK_MIN_BYTES = limit
    sample = _best(CutGuard(plan.slots, GuardMode.SAMPLE).record, repeats)
    return (
        f"{mb:>6} {floor * 1e3:>10.1f} ms {copy * 1e3:>9.1f} ms {tracked * 1e3:>9.2f} ms {seal * 1e3:>7.2f} ms "
        f"{exact * 1e3:>9.1f} ms {sample * 1e3:>6.2f} ms {check * 1e3:>8.1f} ms {tracked / copy:>12.4f}x "
        f"{exact / copy:>7.2f}x"
    )


def _best_tracked(plan: CapturePlan, repeats: int) -> float:
    """The exact cut with write tracking; each guard sealed afterwards (a range is tracked by one guard at a time)."""
    best = float("inf")
    for _ in range(repeats):
        guard = CutGuard(plan.slots, GuardMode.FULL)
        t0 = time.perf_counter()
        guard.record()
        best = min(best, time.perf_counter() - t0)
        guard.seal(guard.slots)
    return best


def _best_seal(plan: CapturePlan, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        guard = CutGuard(plan.slots, GuardMode.FULL)
        guard.record()
        t0 = time.perf_counter()
        guard.seal(guard.slots)
        best = min(best, time.perf_counter() - t0)
    return best


def _arming(mb: int, repeats: int) -> list[float]:
    """Best write-protection time of ``mb`` MB in 8 tensors, pages written first, per way (see ``--arming``)."""
    track = tracker()
    if track is None:
        raise SystemExit("write tracking is not available on this kernel")
    tensors = [torch.randn((mb << 20) // 32) for _ in range(8)]
    spans = [page_interior(t.data_ptr(), t.numel() * 4) for t in tensors]

    def ioctl_wp(part: list[tuple[int, int]]) -> None:
        for start, end in part:
            uffd_calls.ioctl(track._uffd, _UFFDIO_WRITEPROTECT, start, end - start, 1, 0)

    def scan_wp(part: list[tuple[int, int]]) -> None:
        assert not uffd_calls.write_protect(track._pagemap, part)

    def split(way: Callable[[list[tuple[int, int]]], None]) -> Callable[[list[tuple[int, int]]], None]:
        def both(part: list[tuple[int, int]]) -> None:
            helper = threading.Thread(target=way, args=(part[1::2],))
            helper.start()
            way(part[0::2])
            helper.join()

        return both

    out = []
    for way in (ioctl_wp, split(ioctl_wp), scan_wp, split(scan_wp)):
        best = float("inf")
        for _ in range(repeats):
            for t in tensors:
                t.add_(1.0)  # every page written since the last protection
            for span in spans:
                assert track._register(*span)
            t0 = time.perf_counter()
            way(spans)
            best = min(best, time.perf_counter() - t0)
            for span in spans:
                track._disarm(*span)
        out.append(best)
    return out


if __name__ == "__main__":
    main()
