"""O_DIRECT object writes: the pipelined ``DirectFile`` next to a one-thread baseline and the raw floor, same disk.

The baseline is the previous design (copy into one 8 MiB aligned buffer, write it, checksum, repeat, all on one
thread). "busy" runs a pure-Python thread beside the writer, as a training loop launching kernels does: it holds
the GIL, so every return from a system call waits for it. Prints MB/s; asserts nothing.

Usage: python benchmarks/bench_direct.py [--dir /tmp] [--size-mb 1024] [--rounds 2]
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

import numpy as np

from lightning_async_ckpt.storage.direct import DirectFile
from lightning_async_ckpt.storage.io import Checksum


class _Serial:
    """The previous design: one aligned 8 MiB buffer, filled then written on the caller's thread."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.fill = fd, mmap.mmap(-1, 8 << 20), 0
        self.view = memoryview(self.buf)

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), len(self.buf) - self.fill)
            self.view[self.fill : self.fill + n] = view[:n]
            self.fill, view = self.fill + n, view[n:]
            if self.fill == len(self.buf):
                os.write(self.fd, self.view)
                self.fill = 0

    def flush(self) -> None:
        if self.fill:
            os.write(self.fd, self.view[: self.fill - self.fill % 4096])

    def close(self) -> None:
        self.view.release()
        self.buf.close()


def _write(path: str, make, data: np.ndarray, busy: bool) -> float:
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    if busy:
        spinner.start()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    f, summer = make(fd), Checksum("crc32c")
    t0 = time.perf_counter()
    view = memoryview(data)
    for i in range(0, len(data), 64 << 20):  # torch.save hands over one storage at a time
        f.write(view[i : i + (64 << 20)])
        summer.update(view[i : i + (64 << 20)])
    f.flush()
    os.fsync(fd)
    dt = time.perf_counter() - t0
    f.close()
    if isinstance(f, _Serial):
        os.close(fd)
    stop.set()
    return len(data) / dt / 1e6


def _floor(path: str, nbytes: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    buf = mmap.mmap(-1, 32 << 20)
    buf.write(os.urandom(32 << 20))
    t0 = time.perf_counter()
    for _ in range(nbytes // (32 << 20)):
        os.write(fd, buf)
    os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return nbytes / dt / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp", help="folder on the disk to measure")
    parser.add_argument("--size-mb", type=int, default=1024, help="bytes per write, in MiB")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (the order is the same each round)")
    args = parser.parse_args()
    data = np.random.default_rng(0).integers(0, 255, args.size_mb << 20, dtype=np.uint8)
    path = os.path.join(args.dir, "bench_direct.bin")
    try:
        for r in range(args.rounds):
            row = {"floor (O_DIRECT, 32 MiB writes)": _floor(path, len(data))}
            for busy in (False, True):
                tag = " + GIL-busy thread" if busy else ""
                row["serial 8 MiB" + tag] = _write(path, _Serial, data, busy)
                row["pipelined DirectFile" + tag] = _write(path, DirectFile, data, busy)
            print(f"round {r}: " + ", ".join(f"{k} {v:,.0f} MB/s" for k, v in row.items()), flush=True)
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
