"""CRC-32C: the fastest implementation installed, and the combination of two CRCs without reading data again."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from typing import Any

import numpy as np

__all__ = ["DEFAULT_CHECKSUM", "crc32c_combine", "crc32c_in_place", "crc32c_module"]


class _GoogleCrc32c:
    """``google_crc32c`` behind the ``crc32c`` package's ``crc32c(data, value)`` call (its extension takes only
    ``bytes``: a view of a staging buffer is copied first)."""

    def __init__(self, module: Any) -> None:
        self._extend = module.extend

    def crc32c(self, data: bytes | memoryview, value: int = 0) -> int:
        return self._extend(value, data if isinstance(data, bytes) else bytes(data))


# Below this many bytes the GIL is kept through the call (as google-crc32c's own extension does): a release and
# re-acquire per small buffer hands the GIL to the training thread and back, one switch interval each time.
_RELEASE_GIL = 1 << 20


class _LibCrc32c:
    """The C library that ``google-crc32c`` ships (``crc32c_extend``), called through :mod:`ctypes`: it reads any
    contiguous buffer where it lies (no copy), without the GIL from :data:`_RELEASE_GIL` bytes on, like the ``crc32c``
    package; small ``bytes`` go to the package's own extension (no copy either)."""

    def __init__(self, without_gil: Any, with_gil: Any, small: Any) -> None:
        self._without_gil, self._with_gil, self._small = without_gil, with_gil, small

    def crc32c(self, data: bytes | memoryview, value: int = 0) -> int:
        if isinstance(data, bytes) and len(data) < _RELEASE_GIL:
            return self._small(value, data)
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        if not view.nbytes:
            return value
        address = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data  # ``view`` keeps the memory alive
        extend = self._without_gil if view.nbytes >= _RELEASE_GIL else self._with_gil
        return extend(value, address, view.nbytes)


def _bundled_crc32c(module: Any) -> _LibCrc32c | None:
    """:class:`_LibCrc32c` over the library ``google-crc32c`` loaded (its wheel's ``google_crc32c.libs``, else a
    system ``libcrc32c``), checked against the standard check value; ``None`` where none is found."""
    here = os.path.dirname(os.path.abspath(module.__file__))
    candidates = sorted(glob.glob(here + ".libs/libcrc32c*.so*")) + sorted(glob.glob(os.path.join(here, "libcrc32c*")))
    system = ctypes.util.find_library("crc32c")
    for path in [*candidates, *([system] if system else [])]:
        try:
            calls = [ctypes.CDLL(path).crc32c_extend, ctypes.PyDLL(path).crc32c_extend]
        except (OSError, AttributeError):
            continue
        for extend in calls:
            extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            extend.restype = ctypes.c_uint32
        if all(extend(0, b"123456789", 9) == 0xE3069283 for extend in calls):  # CRC-32C's check value
            return _LibCrc32c(*calls, module.extend)
    return None


@functools.cache
def crc32c_module() -> Any:
    """Something with ``crc32c(data, value)``: the ``crc32c`` package where it is installed (hardware-accelerated,
    reads memoryviews without a copy; LGPL-2.1-or-later, so not a dependency), else ``google-crc32c``'s C library
    (Apache-2.0, the declared dependency; hardware-accelerated; through :mod:`ctypes`, without a copy), else its
    Python extension (copies a memoryview first), else ``None``. Looked up once per process.

    ``benchmarks/bench_crc32c.py`` measures them.
    """
    try:
        import crc32c
    except ImportError:
        pass
    else:
        return crc32c
    try:
        import google_crc32c
    except ImportError:
        return None
    return _bundled_crc32c(google_crc32c) or _GoogleCrc32c(google_crc32c)


DEFAULT_CHECKSUM = "crc32c" if crc32c_module() is not None else "crc32"


def crc32c_in_place() -> Any:
    """A :func:`crc32c_module` that reads a buffer where it lies, else ``None``: callers that checksum memory they
    just wrote, to spare a later pass over it, gain nothing from one that copies first."""
    module = crc32c_module()
    return None if isinstance(module, _GoogleCrc32c) else module


_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32C polynomial (reflected bit order, as zlib's ``multmodp``)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return product


_X_POWERS = [1 << 30]  # x^(2^k) modulo the polynomial for k = 0..63 (x^1 is 1 << 30 in reflected order)
for _ in range(63):
    _X_POWERS.append(_multiply(_X_POWERS[-1], _X_POWERS[-1]))


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """CRC-32C of ``A + B`` from the CRC-32C of ``A``, of ``B`` and the length of ``B`` in bytes (no data read)."""
    shift, k, n = 1 << 31, 3, second_length  # x^(8n): n bytes of zeros appended to A
    while n:
        if n & 1:
            shift = _multiply(_X_POWERS[k], shift)
        n >>= 1
        k += 1
    return _multiply(shift, first) ^ second
