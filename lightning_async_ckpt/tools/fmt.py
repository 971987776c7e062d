"""Human-readable numbers for the command line and the backlog model: one formatter per kind of quantity."""

from __future__ import annotations

import math

__all__ = ["fmt_age", "fmt_bytes", "fmt_seconds", "one_line", "print_table"]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float | None) -> str:
    """A byte count in binary units: ``512 B``, ``1.5 KiB``, ``9.31 GiB``; ``-`` for ``None``.

    Args:
        n: Bytes (a rate's sign is kept: ``-2 MiB``), or ``None`` when unknown.
    """
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    for unit in _BYTE_UNITS:
        if value < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{sign}{value:.0f} B" if unit == "B" else f"{sign}{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit always returns")  # pragma: no cover


def fmt_seconds(seconds: float | None) -> str:
    """A duration: ``4.2 s`` below two minutes, then ``min``, then ``h``; ``-`` for ``None`` or non-finite.

    Args:
        seconds: The duration, or ``None`` when unknown.
    """
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.4g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def fmt_age(seconds: float | None) -> str:
    """A compact age for tables: ``42s``, ``17m``, ``5h``, ``3d``; ``-`` for ``None``.

    Args:
        seconds: Seconds since the event (negative clock skew reads as ``0s``), or ``None``.
    """
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def one_line(text: object) -> str:
    """An exception or message on one line (whitespace collapsed); the type name when it has no text."""
    return " ".join(str(text).split()) or type(text).__name__


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print rows as left-aligned columns (the first row is the header); trailing blanks are stripped."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
