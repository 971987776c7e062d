"""Test helpers: a fault-injecting fsspec filesystem that wraps any other one, to test your own storage.

:class:`FaultyFileSystem` delegates every call to a wrapped filesystem and injects the faults you plan with
:class:`Fault` (an ``OSError``, ``ENOSPC`` or ``TimeoutError`` at the k-th call of an operation, a stall on a
``threading.Event``, or a callback at an exact call); ``bandwidth_bps`` caps write throughput.
:func:`register_faulty` registers the ``faulty`` protocol with fsspec (nothing is registered by installing or
importing the package), so a store can be opened as ``faulty:///tmp/ckpt`` with the plan in ``storage_options``
(``docs/testing.md`` has examples). The wrapper is not a ``LocalFileSystem``, so the store uses its object-store
commit path even around a local folder.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from lightning_async_ckpt.errors import ConfigError

__all__ = ["OPS", "Fault", "FaultCall", "FaultyFileSystem", "register_faulty"]

#: Operations a :class:`Fault` can target. ``write``, ``read`` and ``close`` are calls on files opened through the
#: wrapper; the others are filesystem methods of the same name.
OPS = (
    "open",
    "write",
    "read",
    "close",
    "info",
    "exists",
    "ls",
    "cat_file",
    "pipe_file",
    "rm",
    "rm_file",
    "makedirs",
    "mkdir",
    "cp_file",
    "mv",
)
_ERRORS: dict[str, Callable[[str, str], BaseException]] = {
    "oserror": lambda op, path: OSError(errno.EIO, f"injected I/O error at {op} {path}"),
    "enospc": lambda op, path: OSError(errno.ENOSPC, f"No space left on device (injected at {op} {path})"),
    "timeout": lambda op, path: TimeoutError(f"injected timeout at {op} {path}"),
    "connection": lambda op, path: ConnectionResetError(errno.ECONNRESET, f"injected reset at {op} {path}"),
}


@dataclass(frozen=True)
class FaultCall:
    """One call that a :class:`Fault` fired on, as passed to its ``callback``.

    Attributes:
        op: The operation (one of :data:`OPS`).
        path: The path it was called with (without protocol).
        count: How many calls this fault has matched so far, this one included (1-based).
        nbytes: Bytes being written, for ``write`` and ``pipe_file``.
    """

    op: str
    path: str
    count: int
    nbytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Fault:
    """What to inject at which call. A plan is a list of them; each counts its own matching calls.

    When a fault fires it runs, in order: ``callback``, the ``stall``, then raises ``error``. With ``after=True``
    the real operation runs first (the operation took effect but the caller sees the failure: a lost ack).

    Attributes:
        op: The operation to match (one of :data:`OPS`).
        at: Fire at the ``at``-th matching call (1-based).
        times: Fire on this many consecutive matching calls from ``at``; ``None`` fires on every one after it
            (a persistent fault).
        path: Only calls whose path contains this substring match (e.g. ``"manifest.json"``).
        error: ``"oserror"`` (EIO), ``"enospc"``, ``"timeout"``, ``"connection"``, an exception instance or class,
            or ``None`` (no error: only the callback and/or stall).
        stall: Block the call until this event is set.
        stall_timeout_s: Give up the stall after this many seconds with a ``TimeoutError``; ``None`` waits forever.
        callback: Called with a :class:`FaultCall` when the fault fires (e.g. to signal a test, or to kill the
            process at an exact point).
        after: Fire after the real operation instead of before it.
    """

    op: str
    at: int = 1
    times: int | None = 1
    path: str | None = None
    error: str | BaseException | type[BaseException] | None = None
    stall: threading.Event | None = None
    stall_timeout_s: float | None = None
    callback: Callable[[FaultCall], None] | None = None
    after: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ConfigError(f"Fault.op must be one of {', '.join(OPS)}; got {self.op!r}")
        if isinstance(self.at, bool) or not isinstance(self.at, int) or self.at < 1:
            raise ConfigError(f"Fault.at must be an int >= 1 (the k-th matching call), got {self.at!r}")
        if self.times is not None and (
            isinstance(self.times, bool) or not isinstance(self.times, int) or self.times < 1
        ):
            raise ConfigError(f"Fault.times must be None (persistent) or an int >= 1, got {self.times!r}")
        if self.path is not None and not isinstance(self.path, str):
            raise ConfigError(f"Fault.path must be a substring or None, got {self.path!r}")
        err = self.error
        if not (
            err is None
            or err in _ERRORS
            or isinstance(err, BaseException)
            or (isinstance(err, type) and issubclass(err, BaseException))
        ):
            raise ConfigError(f"Fault.error must be one of {sorted(_ERRORS)}, an exception or None; got {err!r}")
        if self.stall is not None and not callable(getattr(self.stall, "wait", None)):
            raise ConfigError("Fault.stall must be a threading.Event (or None)")
        if self.stall_timeout_s is not None and (
            isinstance(self.stall_timeout_s, bool)
            or not isinstance(self.stall_timeout_s, int | float)
            or self.stall_timeout_s < 0
        ):
            raise ConfigError(f"Fault.stall_timeout_s must be None or a number >= 0, got {self.stall_timeout_s!r}")
        if self.callback is not None and not callable(self.callback):
            raise ConfigError("Fault.callback must be callable (or None)")
        if err is None and self.stall is None and self.callback is None:
            raise ConfigError("a Fault needs an error, a stall or a callback; it would do nothing")

    def _matches(self, op: str, path: str) -> bool:
        return op == self.op and (self.path is None or self.path in path)

    def _fires(self, count: int) -> bool:
        return count >= self.at and (self.times is None or count < self.at + self.times)

    def _fire(self, call: FaultCall) -> None:
        if self.callback is not None:
            self.callback(call)
        if self.stall is not None and not self.stall.wait(self.stall_timeout_s):
            raise TimeoutError(f"injected stall at {call.op} {call.path} timed out after {self.stall_timeout_s}s")
        err = self.error
        if err is None:
            return
        if isinstance(err, str):
            raise _ERRORS[err](call.op, call.path)
        if isinstance(err, BaseException):
            raise err
        raise err(f"injected {err.__name__} at {call.op} {call.path}")


class FaultyFileSystem(AbstractFileSystem):
    """An fsspec filesystem that delegates to another one and injects planned faults.

    Thread-safe: counters are updated under a lock; a stalled call blocks only its own thread. Instances are not
    cached by fsspec (every ``url_to_fs`` call gets fresh counters).

    Args:
        fs: The filesystem to wrap (an instance). Alternatively give ``target_protocol``.
        target_protocol: Protocol of the filesystem to wrap (default ``"file"``).
        target_options: Its storage options. A local target gets ``auto_mkdir=True`` unless told otherwise, so
            that, as on an object store, writing a file creates its folder.
        faults: The fault plan.
        bandwidth_bps: Cap on write throughput in bytes per second (``write`` and ``pipe_file``); ``None`` for none.

    Attributes:
        fired: Every call a fault fired on, in order.
    """

    protocol = ("faulty",)
    cachable = False
    root_marker = ""

    def __init__(
        self,
        fs: AbstractFileSystem | None = None,
        *,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        faults: Sequence[Fault] = (),
        bandwidth_bps: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if fs is not None and target_protocol is not None:
            raise ConfigError("give FaultyFileSystem either fs (an instance) or target_protocol, not both")
        if fs is not None and not isinstance(fs, AbstractFileSystem):
            raise ConfigError(f"fs must be an fsspec filesystem instance, got {type(fs).__name__}")
        if target_options is not None and not isinstance(target_options, dict):
            raise ConfigError(f"target_options must be a dict or None, got {type(target_options).__name__}")
        faults = list(faults)
        for fault in faults:
            if not isinstance(fault, Fault):
                raise ConfigError(f"faults must be Fault instances, got {type(fault).__name__}")
        if bandwidth_bps is not None and (
            isinstance(bandwidth_bps, bool) or not isinstance(bandwidth_bps, int | float) or bandwidth_bps <= 0
        ):
            raise ConfigError(f"bandwidth_bps must be None or a number > 0, got {bandwidth_bps!r}")
        if fs is None:
            protocol = target_protocol or "file"
            options = dict(target_options or {})
            if protocol in ("file", "local"):
                options.setdefault("auto_mkdir", True)
            fs = fsspec.filesystem(protocol, **options)
        self.fs = fs
        self.faults = faults
        self.bandwidth_bps = bandwidth_bps
        self.fired: list[FaultCall] = []
        self._lock = threading.Lock()
        self._matched = [0] * len(faults)
        self._counts: Counter[tuple[str, str]] = Counter()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        for prefix in ("faulty://", "faulty::"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        return path.rstrip("/") or ("/" if path.startswith("/") else "")

    # -- accounting --------------------------------------------------------------------------------------
    def count(self, op: str, path: str | None = None) -> int:
        """How many ``op`` calls were made (started), optionally only on paths containing ``path``."""
        with self._lock:
            return sum(n for (o, p), n in self._counts.items() if o == op and (path is None or path in p))

    def _call(self, op: str, path: str, fn: Callable[[], Any], nbytes: int = 0) -> Any:
        with self._lock:
            self._counts[(op, path)] += 1
            due = []
            for i, fault in enumerate(self.faults):
                if fault._matches(op, path):
                    self._matched[i] += 1
                    if fault._fires(self._matched[i]):
                        call = FaultCall(op=op, path=path, count=self._matched[i], nbytes=nbytes)
                        self.fired.append(call)
                        due.append((fault, call))
        for fault, call in due:
            if not fault.after:
                fault._fire(call)
        if nbytes and self.bandwidth_bps:
            time.sleep(nbytes / self.bandwidth_bps)
        result = fn()
        for fault, call in due:
            if fault.after:
                fault._fire(call)
        return result

    # -- delegated filesystem methods --------------------------------------------------------------------
    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> _FaultyFile:
        raw = self._call(
            "open",
            path,
            lambda: self.fs.open(
                path, mode, block_size=block_size, cache_options=cache_options, autocommit=autocommit, **kwargs
            ),
        )
        return _FaultyFile(self, path, raw)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._call("info", path, lambda: self.fs.info(path, **kwargs))

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._call("exists", path, lambda: self.fs.exists(path, **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        return self._call("ls", path, lambda: self.fs.ls(path, detail=detail, **kwargs))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        return self._call("cat_file", path, lambda: self.fs.cat_file(path, start=start, end=end, **kwargs))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        return self._call("pipe_file", path, lambda: self.fs.pipe_file(path, value, mode=mode, **kwargs), len(value))

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        return self._call("rm", path, lambda: self.fs.rm(path, recursive=recursive, maxdepth=maxdepth))

    def rm_file(self, path: str) -> None:
        return self._call("rm_file", path, lambda: self.fs.rm_file(path))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        return self._call("makedirs", path, lambda: self.fs.makedirs(path, exist_ok=exist_ok))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        return self._call("mkdir", path, lambda: self.fs.mkdir(path, create_parents=create_parents, **kwargs))

    def rmdir(self, path: str) -> None:
        return self.fs.rmdir(path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        return self._call("cp_file", path1, lambda: self.fs.cp_file(path1, path2, **kwargs))

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        return self._call(
            "mv", path1, lambda: self.fs.mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        )

    def modified(self, path: str) -> Any:
        return self.fs.modified(path)

    def created(self, path: str) -> Any:
        return self.fs.created(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path)

    def __repr__(self) -> str:
        return f"FaultyFileSystem({self.fs!r}, faults={len(self.faults)}, bandwidth_bps={self.bandwidth_bps})"


class _FaultyFile:
    """A file opened through :class:`FaultyFileSystem`: ``write``/``read``/``close`` go through the fault plan."""

    def __init__(self, owner: FaultyFileSystem, path: str, raw: Any) -> None:
        self._owner = owner
        self._path = path
        self._raw = raw

    def write(self, data: Any) -> int:
        nbytes = memoryview(data).nbytes
        return self._owner._call("write", self._path, lambda: self._raw.write(data), nbytes)

    def read(self, size: int = -1) -> bytes:
        return self._owner._call("read", self._path, lambda: self._raw.read(size))

    def close(self) -> None:
        if self._raw.closed:
            return
        try:
            self._owner._call("close", self._path, self._raw.close)
        finally:
            if not self._raw.closed:
                # An injected failure came first: still release the handle (what was written may land; the caller
                # saw the close fail, as after a lost acknowledgement).
                self._raw.close()

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Any:
        return iter(self._raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def register_faulty() -> None:
    """Register :class:`FaultyFileSystem` as fsspec's ``faulty://`` protocol in this process (idempotent).

    Call it in the test (or test process) that names ``faulty://`` URLs; installing or importing the package
    registers nothing.
    """
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
