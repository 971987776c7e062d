"""The physical floors the preset (``_bench_preset.py``) measures in the same run, beside the modes.

* :func:`cpu_floor`: CPU seconds per GB on this thread's clock: one memcpy, one CRC-32C (the library's checksum
  function), and the write syscalls of that GB (buffered ``write`` + ``fsync``, and ``O_DIRECT`` + ``fsync``);
* :func:`hooks_floor`: seconds on the training thread that a fit of ``cuts`` checkpoints cannot go below with this
  design: the final checkpoint's copy at the cut (torch's copy of every byte into preallocated buffers) and, per
  deferred cut, the write tracker's arming of every byte, right after an Adam step wrote them (an ``add_`` before it
  measured ~1.5x slower arming than the optimizer's own writes: the floor follows the preset's fit).

Loaded by path from ``_bench_preset.py`` (``bench`` is not on ``sys.path``).
"""

from __future__ import annotations

import os
import time

__all__ = ["cpu_floor", "hooks_floor"]

_CHUNK = 8 << 20
_TENSOR = 64 << 20  # the hooks floor's state, in tensors of this size (a 4096 x 4096 fp32 weight)


def cpu_floor(nbytes: int, folder: str) -> dict[str, float]:
    """CPU seconds per GB, on this thread's clock: one memcpy, one CRC-32C (the library's), write + fsync."""
    import torch

    from lightning_async_ckpt.storage.io import DEFAULT_CHECKSUM, Checksum

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.fill_(0)  # fault the pages in first
    source, target = memoryview(src.numpy()), memoryview(dst.numpy())
    gb = nbytes / 1e9
    t0 = time.thread_time()
    target[:] = source  # one memcpy, one thread
    memcpy = time.thread_time() - t0
    digest = Checksum(DEFAULT_CHECKSUM)
    t0 = time.thread_time()
    for i in range(0, nbytes, _CHUNK):
        digest.update(source[i : i + _CHUNK])
    checksum = time.thread_time() - t0
    path = os.path.join(folder, "cpu-floor.bin")
    t0 = time.thread_time()
    with open(path, "wb", buffering=0) as f:
        for i in range(0, nbytes, _CHUNK):
            f.write(source[i : i + _CHUNK])
        os.fsync(f.fileno())
    write = time.thread_time() - t0
    os.unlink(path)
    direct = _direct_write_cpu(source, path)
    return {
        "memcpy": memcpy / gb,
        f"{DEFAULT_CHECKSUM}": checksum / gb,
        "write+fsync": write / gb,
        **({} if direct is None else {"O_DIRECT write+fsync": direct / gb}),
        # The cheapest way to write, as this library writes on a local disk (O_DIRECT) where the disk takes it.
        "floor": (memcpy + checksum + min(write, write if direct is None else direct)) / gb,
    }


def _direct_write_cpu(source: memoryview, path: str) -> float | None:
    """CPU seconds of writing ``source`` with ``O_DIRECT`` from page-aligned memory, then ``fsync``; ``None`` where
    the filesystem refuses ``O_DIRECT``."""
    import mmap

    if len(source) < mmap.PAGESIZE:
        return None
    aligned = mmap.mmap(-1, len(source) - len(source) % mmap.PAGESIZE)
    view = memoryview(aligned)
    view[:] = source[: len(aligned)]  # not timed: only the write is
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = None
    try:
        if fd is None:
            return None
        t0 = time.thread_time()
        for i in range(0, len(view), _CHUNK):
            os.write(fd, view[i : i + _CHUNK])
        os.fsync(fd)
        return time.thread_time() - t0
    except OSError:
        return None
    finally:
        if fd is not None:
            os.close(fd)
            os.unlink(path)
        view.release()
        aligned.close()


def hooks_floor(nbytes: int, cuts: int, repeats: int = 3) -> dict[str, float]:
    """Best of ``repeats``, in seconds, for a state of ``nbytes``: fp32 parameters of 64 MiB each with Adam's two
    moments (so a third of the bytes are parameters, as in the preset), written by an Adam step before each cut.

    ``final copy``: every byte copied at the cut (8-byte words, torch's threads, into preallocated buffers);
    ``arming``: one cut's write protection of the same bytes (absent where the kernel cannot track writes);
    ``hooks floor``: the copy + ``cuts - 1`` armings.
    """
    import torch

    from lightning_async_ckpt.core.write_tracker import page_interior, tracker

    count = max(1, nbytes // (3 * _TENSOR))
    params = [torch.nn.Parameter(torch.randn(_TENSOR // 4)) for _ in range(count)]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.Adam(params, lr=1e-5)
    optimizer.step()  # the moments exist from here on
    state = [*params, *(optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq"))]
    scale = nbytes / sum(t.numel() * t.element_size() for t in state)
    buffers = [torch.empty(_TENSOR // 8, dtype=torch.int64) for _ in state]
    copy = arming = float("inf")
    track = tracker()
    spans = [page_interior(t.data_ptr(), t.numel() * 4) for t in state]
    accepted: set[tuple[int, int]] = set()
    for _ in range(repeats):
        optimizer.step()  # every page written since the last cut
        t0 = time.perf_counter()
        with torch.no_grad():
            for t, buf in zip(state, buffers, strict=True):
                buf.copy_(t.view(torch.int64))
        copy = min(copy, time.perf_counter() - t0)
        if track is None:
            continue
        optimizer.step()
        t0 = time.perf_counter()
        armed = track.protect_all(spans, accepted)  # as at a later cut: the same storages, maps not read again
        arming = min(arming, time.perf_counter() - t0)
        accepted = {span for span, ok in zip(spans, armed, strict=True) if ok}
        for span in accepted:
            track.release(*span)
    out = {"final copy": copy * scale}
    if arming < float("inf"):
        out["arming"] = arming * scale
    out["hooks floor"] = out["final copy"] + (cuts - 1) * out.get("arming", 0.0)
    return out
