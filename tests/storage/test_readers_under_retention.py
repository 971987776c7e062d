"""Readers racing a writer's retention (``keep_last=1``): ``latest()`` and ``latest_checkpoint()`` never answer
"no checkpoint" and never raise once a first generation is committed.

The gated tests stop the reader at one point of its walk (right after it listed the folder, or right before it
stats the chosen generation's object), let the writer commit a new generation and retire the old one, then let the
reader go on. The loop test runs a reader thread against a writer committing with ``keep_last=1``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lightning_async_ckpt import latest_checkpoint
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.gate import JOIN_S, Gate

Location = tuple[str, dict[str, Any] | None]


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Any) -> Location:
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3_uri")


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", f"step {step}".encode() * 64)
    writer.commit()
    store.gc(1)


def _run_gated(gate: Gate, read: Callable[[], Any], writer: CheckpointStore, step: int) -> Any:
    result: dict[str, Any] = {}

    def reader() -> None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result["value"] = read()
            result["warnings"] = [str(w.message) for w in caught]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            result["error"] = exc

    gate.reader = threading.Thread(target=reader, name="test-reader")
    gate.reader.start()
    try:
        assert gate.reached.wait(JOIN_S), "the reader never reached the gate"
        _commit(writer, step)  # commits `step` and retires the generation the reader chose
    finally:
        gate.release.set()
        gate.reader.join(JOIN_S)
    assert not gate.reader.is_alive()
    assert "error" not in result, f"the reader raised {result.get('error')!r}"
    return result


def _readers(location: Location) -> Iterator[tuple[str, Callable[[], Any], Callable[[Any], int | None]]]:
    uri, options = location
    reader = CheckpointStore(uri, options, check_writable=False)
    yield "latest", reader.latest, lambda info: None if info is None else info.step
    yield (
        "latest_checkpoint",
        lambda: latest_checkpoint(uri, options),
        lambda path: None if path is None else int(path.rsplit("/step-", 1)[1].split("/")[0]),
    )


@pytest.mark.parametrize("which", ["latest", "latest_checkpoint"])
def test_a_generation_retired_after_the_listing_is_not_no_checkpoint(
    location: Location, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, options = location
    writer = CheckpointStore(uri, options, run_id="writer")
    _commit(writer, 1)
    read, step_of = next((r, s) for name, r, s in _readers(location) if name == which)
    root = writer.root
    gate = Gate(monkeypatch, writer.fs, "ls", lambda path: path.rstrip("/").endswith(root.rsplit("/", 1)[-1]))
    result = _run_gated(gate, read, writer, 2)
    assert step_of(result["value"]) == 2  # step 1 was listed, then retired: the reader lists again
    assert not [w for w in result["warnings"] if "skipping" in w], result["warnings"]


@pytest.mark.parametrize("which", ["latest", "latest_checkpoint"])
def test_a_generation_retired_while_it_is_verified_is_not_no_checkpoint(
    location: Location, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, options = location
    writer = CheckpointStore(uri, options, run_id="writer")
    _commit(writer, 1)
    read, step_of = next((r, s) for name, r, s in _readers(location) if name == which)
    gate = Gate(monkeypatch, writer.fs, "info", lambda path: path.endswith("step-00000001/checkpoint.ckpt"))
    result = _run_gated(gate, read, writer, 2)
    assert step_of(result["value"]) == 2  # its manifest was read, then it was retired: never "damaged", never None
    assert not [w for w in result["warnings"] if "skipping" in w], result["warnings"]


def test_readers_looping_while_keep_last_1_commits_never_see_none_nor_an_error(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    writer = CheckpointStore(uri, run_id="writer")
    _commit(writer, 0)
    done = threading.Event()
    outcomes: dict[str, list[str]] = {"latest": [], "latest_checkpoint": []}
    calls = {name: 0 for name in outcomes}

    def loop(name: str, read: Callable[[], Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while not done.is_set():
                try:
                    got = read()
                except Exception as exc:  # noqa: BLE001 - collected and asserted below
                    outcomes[name].append(f"{type(exc).__name__}: {exc}")
                else:
                    if got is None:
                        outcomes[name].append("None")
                calls[name] += 1

    threads = [
        threading.Thread(target=loop, args=(name, read), name=f"test-{name}") for name, read, _ in _readers((uri, None))
    ]
    for thread in threads:
        thread.start()
    try:
        # At least 300 commits, and more until every reader has finished a call while commits went on (a loaded
        # machine may start a reader late); bounded so a reader that never returns fails the assertion below.
        step = 1
        while step < 300 or (not all(calls.values()) and step < 3000):
            _commit(writer, step)
            step += 1
    finally:
        done.set()
        for thread in threads:
            thread.join(JOIN_S)
    assert all(calls.values()), calls
    assert outcomes == {"latest": [], "latest_checkpoint": []}, (calls, {k: v[:5] for k, v in outcomes.items()})


def test_a_store_holding_only_an_uncommitted_leftover_is_no_checkpoint(location: Location) -> None:
    """The relisting ends: two walks over one listing that saw the same leftover say "no checkpoint"."""
    uri, options = location
    store = CheckpointStore(uri, options, run_id="crashed")
    writer = store.begin(3)
    writer.write_bytes("checkpoint.ckpt", b"partial")  # never committed (a crash before the manifest)
    reader = CheckpointStore(uri, options, check_writable=False)
    assert reader.latest() is None
    assert latest_checkpoint(uri, options) is None
    writer.abort()
