"""A gate on one filesystem call of one thread: stop a reader at a chosen point of its walk, deterministically."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

#: The longest a test waits for a gated thread to reach, or be released from, its gate.
JOIN_S = 60.0


class Gate:
    """Stop the reader thread once at a filesystem call (after ``ls`` of the root, or before ``info`` of an
    object), until the test releases it; every other thread passes through.

    A local filesystem instance is cached per thread (the reader's stores get their own), so its class is patched;
    an async one (S3) is shared by every thread, and its sync methods are attributes of the instance.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fs: Any, method: str, match: Callable[[str], bool]) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.reader: threading.Thread | None = None
        on_instance = getattr(type(fs), "async_impl", False)
        target = fs if on_instance else type(fs)
        original = getattr(target, method)
        after = method == "ls"

        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            mine = threading.current_thread() is self.reader and match(str(path)) and not self.reached.is_set()
            if mine and not after:
                self._hold()
            out = original(path, *args, **kwargs)
            if mine and after:
                self._hold()
            return out

        def _bound(instance: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            mine = threading.current_thread() is self.reader and match(str(path)) and not self.reached.is_set()
            if mine and not after:
                self._hold()
            out = original(instance, path, *args, **kwargs)
            if mine and after:
                self._hold()
            return out

        monkeypatch.setattr(target, method, call if on_instance else _bound)

    def _hold(self) -> None:
        self.reached.set()
        assert self.release.wait(JOIN_S), "the test never released the reader"


def run_gated(gate: Gate, read: Callable[[], Any], meanwhile: Callable[[], None]) -> Any:
    """Run ``read`` on a thread held at ``gate``; run ``meanwhile`` while it is held; return what ``read`` returned.

    Raises:
        BaseException: What ``read`` raised.
    """
    result: dict[str, Any] = {}

    def reader() -> None:
        try:
            result["value"] = read()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
            result["error"] = exc

    gate.reader = threading.Thread(target=reader, name="test-reader")
    gate.reader.start()
    try:
        assert gate.reached.wait(JOIN_S), "the reader never reached the gate"
        meanwhile()
    finally:
        gate.release.set()
        gate.reader.join(JOIN_S)
    assert not gate.reader.is_alive()
    if "error" in result:
        raise result["error"]
    return result["value"]
