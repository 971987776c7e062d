"""``tools/fmt.py``: the one place numbers are formatted for people (CLI tables, plan text, planner notes)."""

from __future__ import annotations

import math

import pytest

from lightning_async_ckpt.tools.fmt import fmt_age, fmt_bytes, fmt_seconds, one_line


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "-"),
        (0, "0 B"),
        (1000, "1000 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (18 * 1024 + 400, "18.4 KiB"),
        (10 * 1024**3, "10 GiB"),
        (5 * 1024**5, "5.12e+03 TiB"),
        (-3 * 1024**2, "-3 MiB"),  # a rate's sign survives (lambda - mu < 0)
    ],
)
def test_fmt_bytes(n: float | None, text: str) -> None:
    assert fmt_bytes(n) == text


@pytest.mark.parametrize(
    ("s", "text"),
    [
        (None, "-"),
        (math.inf, "-"),
        (0.0123, "0.0123 s"),
        (30, "30 s"),
        (119.5, "119.5 s"),
        (300, "5 min"),
        (7200, "2 h"),
    ],
)
def test_fmt_seconds(s: float | None, text: str) -> None:
    assert fmt_seconds(s) == text


def test_fmt_age_and_one_line() -> None:
    assert [fmt_age(v) for v in (None, -5, 42, 600, 18000, 3 * 86400)] == ["-", "0s", "42s", "10m", "5h", "3d"]
    assert one_line(ValueError("a\n  b\tc")) == "a b c"
    assert one_line(ValueError()) == "ValueError"
