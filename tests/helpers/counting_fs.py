"""A real fsspec memory filesystem that counts its calls: the requests a store makes, for request-count tests.

:class:`CountingMemoryFileSystem` is fsspec's ``MemoryFileSystem`` (the same process-global files), registered
under the ``countmem://`` protocol; every call of the primitives an object store turns into requests (listing,
metadata, reading, writing, deleting) is counted in :attr:`CountingMemoryFileSystem.calls`, by method name.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

__all__ = ["CountingMemoryFileSystem", "PROTOCOL"]

PROTOCOL = "countmem"
# The primitives of MemoryFileSystem that its other methods (find, exists, cat, rm ...) end in.
_COUNTED = ("ls", "info", "cat_file", "_open", "pipe_file", "rm_file", "rmdir", "mkdir", "makedirs", "cp_file")


class CountingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under ``countmem://``, counting calls of its primitives in :attr:`calls`."""

    protocol = (PROTOCOL,)
    calls: ClassVar[Counter[str]] = Counter()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
            path = "memory://" + path[len(PROTOCOL) + 3 :]
        return MemoryFileSystem._strip_protocol(path)


def _counted(name: str) -> Any:
    real = getattr(MemoryFileSystem, name)

    @functools.wraps(real)
    def call(self: CountingMemoryFileSystem, *args: Any, **kwargs: Any) -> Any:
        CountingMemoryFileSystem.calls[name] += 1
        return real(self, *args, **kwargs)

    return call


for _name in _COUNTED:
    setattr(CountingMemoryFileSystem, _name, _counted(_name))
fsspec.register_implementation(PROTOCOL, CountingMemoryFileSystem, clobber=True)
