"""Store write throughput next to a raw sequential write with fsync, on the same disk.

Streams one object of ``--size-mb`` through ``CheckpointStore`` (begin, write in ``--chunk-mb`` pieces, close
with fsync, commit the manifest) for each checksum, and writes the same bytes with plain
``open``/``write``/``fsync``. The bytes are generated before any clock starts; one untimed write warms the
page cache; rounds rotate the order and medians are reported. Prints; asserts nothing. CPU-bound checksums
make the figures sensitive to other load on the machine: the load average is printed with them.

Usage::

    python benchmarks/bench_store.py                      # 1 GiB under /tmp, 3 rounds
    python benchmarks/bench_store.py --size-mb 256 --dir /mnt/nvme --repeat 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

from lightning_async_ckpt.storage.store import CheckpointStore

MIB = 1 << 20
# Distinct chunks cycled to make up the object: random enough that nothing can compress or deduplicate a
# pattern, small enough not to double the benchmark's memory.
POOL_CHUNKS = 8


def _chunks(size: int, chunk: int) -> list[memoryview]:
    pool = [memoryview(os.urandom(chunk)) for _ in range(min(POOL_CHUNKS, -(-size // chunk)))]
    out, left, i = [], size, 0
    while left > 0:
        piece = pool[i % len(pool)]
        out.append(piece[: min(chunk, left)])
        left -= len(out[-1])
        i += 1
    return out


def _raw(folder: str, chunks: list[memoryview]) -> dict[str, float]:
    path = os.path.join(folder, "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for piece in chunks:
            f.write(piece)
        t1 = time.perf_counter()
        f.flush()
        os.fsync(f.fileno())
    t2 = time.perf_counter()
    os.unlink(path)
    return {"total": t2 - t0, "write": t1 - t0, "fsync": t2 - t1}


def _raw_direct(folder: str, chunks: list[memoryview]) -> dict[str, float]:
    """The disk's own floor: O_DIRECT writes from one aligned buffer, no checksum, then fsync."""
    import mmap

    path = os.path.join(folder, "raw-direct.bin")
    buf = mmap.mmap(-1, max(len(c) for c in chunks))
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    try:
        for piece in chunks:
            view[: len(piece)] = piece
            os.write(fd, view[: len(piece)])
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        buf.close()
    t2 = time.perf_counter()
    os.unlink(path)
    return {"total": t2 - t0, "write": t1 - t0, "fsync": t2 - t1}


def _store(folder: str, chunks: list[memoryview], checksum: str) -> dict[str, float]:
    root = os.path.join(folder, f"store-{checksum}")
    store = CheckpointStore(root, checksum=checksum)
    t0 = time.perf_counter()
    writer = store.begin(1)
    stream = writer.open("checkpoint.ckpt")
    for piece in chunks:
        stream.write(piece)
    t1 = time.perf_counter()
    stream.close()  # flush + fsync
    t2 = time.perf_counter()
    writer.commit()  # manifest: temp file, fsync, rename, fsync folder
    t3 = time.perf_counter()
    shutil.rmtree(root)
    return {"total": t3 - t0, "write": t1 - t0, "fsync": t2 - t1, "commit": t3 - t2}


def _checksum_only(chunks: list[memoryview], checksum: str) -> float:
    t0 = time.perf_counter()
    if checksum == "crc32":
        crc = 0
        for piece in chunks:
            crc = zlib.crc32(piece, crc)
    elif checksum == "crc32c":
        from lightning_async_ckpt.storage.io import crc32c_module

        crc32c, crc = crc32c_module(), 0  # what the store uses: crc32c where installed, else google-crc32c
        for piece in chunks:
            crc = crc32c.crc32c(piece, crc)
    else:
        digest = hashlib.sha256()
        for piece in chunks:
            digest.update(piece)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="object size in MiB (default 1024)")
    parser.add_argument("--chunk-mb", type=int, default=8, help="size of each write in MiB (default 8)")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir in /tmp)")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds; medians are reported (default 3)")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.chunk_mb < 1 or args.repeat < 1:
        parser.error("--size-mb, --chunk-mb and --repeat must be >= 1")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    size = args.size_mb * MIB
    chunks = _chunks(size, args.chunk_mb * MIB)
    base = args.dir or "/tmp"
    os.makedirs(base, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="lac-bench-", dir=base)
    print(f"object {args.size_mb} MiB in {len(chunks)} writes of {args.chunk_mb} MiB, folder {folder}")
    print(
        f"python {platform.python_version()}, zlib {zlib.ZLIB_RUNTIME_VERSION}, {os.cpu_count()} cpus, "
        f"{platform.machine()}, repeat {args.repeat}, load average {load:.2f}"
    )

    def mibs(seconds: float) -> float:
        return size / MIB / seconds

    runs: dict[str, list[dict[str, float]]] = {"raw": [], "raw-direct": [], "crc32c": [], "crc32": [], "sha256": []}
    jobs: dict[str, Callable[[], dict[str, float]]] = {
        "raw": lambda: _raw(folder, chunks),
        "raw-direct": lambda: _raw_direct(folder, chunks),
        "crc32c": lambda: _store(folder, chunks, "crc32c"),
        "crc32": lambda: _store(folder, chunks, "crc32"),
        "sha256": lambda: _store(folder, chunks, "sha256"),
    }
    try:
        # Untimed: the first write of a process into the page cache is several times slower on some VMs
        # (host pages faulted in), which would penalize whichever run comes first.
        _raw(folder, chunks)
        order = list(jobs)
        for round_ in range(args.repeat):
            for name in order:
                os.sync()  # start each run with no dirty pages left by the previous one
                result = jobs[name]()
                runs[name].append(result)
                print(f"  round {round_ + 1} {name:<7}{mibs(result['total']):>7.0f} MiB/s")
            order = order[1:] + order[:1]  # rotate so no run always follows the same one
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    # The floor is the faster of the two raw writes (page cache + fsync, or O_DIRECT + fsync) on this disk.
    raw_total = min(statistics.median(r["total"] for r in runs[k]) for k in ("raw", "raw-direct"))
    print()
    print(f"{'run':<22}{'MiB/s':>9}{'% raw':>8}{'seconds':>9}   phases (s)")
    for name, label in (
        ("raw", "raw write+fsync"),
        ("raw-direct", "raw O_DIRECT+fsync"),
        ("crc32c", "store crc32c"),
        ("crc32", "store crc32"),
        ("sha256", "store sha256"),
    ):
        med = {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
        phases = ", ".join(f"{k} {v:.2f}" for k, v in med.items() if k != "total")
        pct = 100.0 * raw_total / med["total"]
        print(f"{label:<22}{mibs(med['total']):>9.0f}{pct:>7.0f}%{med['total']:>9.2f}   {phases}")
    for algo in ("crc32c", "crc32", "sha256"):
        print(f"{algo + ' in memory only':<22}{mibs(_checksum_only(chunks, algo)):>9.0f}")


if __name__ == "__main__":
    sys.exit(main())
