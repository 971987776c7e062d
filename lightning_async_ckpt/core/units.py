"""Sizes written with units (``4GiB``, ``512MB``, ``1e9``), as the CLI and the YAML of LightningCLI spell them."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_p}b"] = _SIZE_UNITS[_p] = 1000**_i
    _SIZE_UNITS[f"{_p}ib"] = _SIZE_UNITS[f"{_p}i"] = 1024**_i


def parse_size(text: str) -> float:
    """Bytes of ``4GiB`` (binary units), ``500MB``/``500M`` (decimal), ``1e9`` or ``1000000``.

    Raises:
        ValueError: ``text`` is not a number with one of those units.
    """
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 1000000, 512MB, 4GiB)")
    return float(match.group(1)) * _SIZE_UNITS[unit]
