"""Damage a committed object the way a bad disk would: its last bytes flipped, its size unchanged."""

from __future__ import annotations

from pathlib import Path


def flip_tail(path: Path | str) -> None:
    """Invert the last 4 bytes of ``path`` in place (the checksum no longer matches; the size does)."""
    with open(path, "r+b") as f:
        f.seek(-4, 2)
        tail = f.read(4)
        f.seek(-4, 2)
        f.write(bytes(b ^ 0xFF for b in tail))
