"""CRC-32C throughput of the two packages the checksum can use: ``google-crc32c`` (Apache-2.0) and ``crc32c``
(LGPL-2.1-or-later). Both are hardware-accelerated where the CPU has CRC instructions.

    python benchmarks/bench_crc32c.py [--mib 256] [--runs 5]

Prints GB/s per package and chunk size. The store checksums memoryviews of its staging buffers;
``google_crc32c``'s C extension takes only ``bytes``, so its figure includes the copy it would need
(``bytes(view)``), and its figure on ``bytes`` (no copy) is printed beside it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time


def _update(name: str):
    if name == "google_crc32c":
        module = importlib.import_module("google_crc32c")
        return lambda data, value: module.extend(value, bytes(data)), module.implementation
    module = importlib.import_module("crc32c")
    return lambda data, value: module.crc32c(data, value), "hardware" if module.hardware_based else "software"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes checksummed per run (MiB)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    data = os.urandom(args.mib << 20)
    view = memoryview(data)
    for name in ("google_crc32c", "crc32c"):
        try:
            update, impl = _update(name)
        except ImportError:
            print(f"{name}: not installed")
            continue
        for chunk in (64 << 10, 8 << 20):
            rates = []
            for _ in range(args.runs):
                value, start = 0, time.perf_counter()
                for offset in range(0, len(data), chunk):
                    value = update(view[offset : offset + chunk], value)
                rates.append(len(data) / (time.perf_counter() - start) / 1e9)
            if name == "google_crc32c":  # on bytes already (no copy): what it costs without the staging buffers
                module, no_copy = importlib.import_module("google_crc32c"), []
                chunks = [data[o : o + chunk] for o in range(0, len(data), chunk)]
                for _ in range(args.runs):
                    value, start = 0, time.perf_counter()
                    for piece in chunks:
                        value = module.extend(value, piece)
                    no_copy.append(len(data) / (time.perf_counter() - start) / 1e9)
                print(
                    f"  google_crc32c on bytes (no copy), chunk {chunk >> 10} KiB: median "
                    f"{sorted(no_copy)[len(no_copy) // 2]:.2f} GB/s"
                )
            print(
                f"{name} ({impl}) chunk {chunk >> 10} KiB: median {sorted(rates)[len(rates) // 2]:.2f} GB/s, "
                f"min {min(rates):.2f}, max {max(rates):.2f} ({args.runs} runs of {args.mib} MiB)"
            )


if __name__ == "__main__":
    main()
