"""Issue 43, point 1: ``add_commit_callback`` on the engine (plain loops), and the durable event of two tiers.

Commits are waited for through the ``committed`` futures (never sleeps); callbacks run on the training thread.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch import nn

from lightning_async_ckpt.core.commit_hooks import CommitCallbackError, Committed
from lightning_async_ckpt.core.engine import AsyncCheckpointer
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer


def _state(model: nn.Module) -> dict:
    return {"model": model.state_dict()}


def test_each_commit_reaches_the_callback_once_on_the_training_thread_after_its_manifest(tmp_path):
    model = nn.Linear(4, 4)
    seen: list[tuple[Committed, threading.Thread, bool]] = []
    store = CheckpointStore(str(tmp_path))

    def hook(committed: Committed) -> None:
        manifest_there = (tmp_path / f"step-{committed.step:08d}" / "manifest.json").is_file()
        seen.append((committed, threading.current_thread(), manifest_there))

    with AsyncCheckpointer(store) as ckpt:
        ckpt.add_commit_callback(hook)
        first = ckpt.save(1, _state(model), extra={"metrics": {"loss": 0.5, "note": "not a number"}})
        first.committed.result()
        assert seen == []  # never on the upload thread: delivered at the next call on the training thread
        ckpt.poll()
        assert [c.step for c, _, _ in seen] == [1]
        ckpt.save(2, _state(model)).committed.result()
        ckpt.drain()
        ckpt.poll()
    assert [c.step for c, _, _ in seen] == [1, 2]  # once each, oldest first
    assert all(thread is threading.main_thread() and there for _, thread, there in seen)
    one, two = seen[0][0], seen[1][0]
    assert one.tier == "durable" and one.uri == store.url(1)
    assert (
        one.path == store.url(1, "checkpoint.ckpt")
        and torch.load(one.path)["model"].keys() == model.state_dict().keys()
    )
    assert dict(one.metrics) == {"loss": 0.5}
    assert one.manifest.run_id == store.run_id and one.manifest.files == ("checkpoint.ckpt",)
    assert one.manifest.total_bytes == store.manifest(1).total_bytes and one.manifest.format == "torch_save"
    assert one.is_last and two.is_last  # each the newest committed when it was delivered
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.step = 3  # type: ignore[misc]


def test_close_delivers_the_last_commit(tmp_path):
    seen: list[int] = []
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as ckpt:
        ckpt.add_commit_callback(lambda c: seen.append(c.step))
        ckpt.save(5, {"w": torch.ones(3)})
    assert seen == [5]


def test_a_callback_that_raises_is_reported_once_like_a_save_error_and_the_checkpoint_stays(tmp_path):
    store = CheckpointStore(str(tmp_path))
    calls: list[int] = []

    def bad(committed: Committed) -> None:
        calls.append(committed.step)
        raise ValueError("upload refused")

    ckpt = AsyncCheckpointer(store)
    ckpt.add_commit_callback(bad)
    ckpt.save(1, {"w": torch.ones(3)}).committed.result()
    with pytest.raises(CommitCallbackError, match="upload refused") as raised:
        ckpt.poll()
    assert isinstance(raised.value.__cause__, ValueError) and "step 1" in str(raised.value)
    ckpt.poll()  # once: not raised again
    ckpt.save(2, {"w": torch.ones(3)}).committed.result()
    with pytest.raises(CommitCallbackError):
        ckpt.close()
    assert calls == [1, 2]
    assert [g.step for g in store.generations()] == [1, 2]  # both committed all the same


def test_a_callback_that_raises_with_on_error_warn_is_logged(tmp_path, caplog):
    ckpt = AsyncCheckpointer(CheckpointStore(str(tmp_path)), on_error="warn")
    ckpt.add_commit_callback(lambda c: 1 / 0)
    ckpt.save(1, {"w": torch.ones(3)}).committed.result()
    with caplog.at_level("WARNING", logger="lightning_async_ckpt"):
        ckpt.poll()
        ckpt.close()
    assert "commit callback" in caplog.text and "ZeroDivisionError" in caplog.text


def test_a_non_callable_is_refused(tmp_path):
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as ckpt, pytest.raises(TypeError, match="callable"):
        ckpt.add_commit_callback("not a function")  # type: ignore[arg-type]


def test_two_tiers_tell_the_local_commit_and_the_promotion_apart(tmp_path):
    seen: list[Committed] = []
    tiered = TieredCheckpointer(str(tmp_path / "local"), str(tmp_path / "durable"), every_n_train_steps=2)
    tiered.add_commit_callback(seen.append)
    for step in (1, 2):
        tiered.save(step, {"w": torch.full((3,), float(step))}).committed.result()
    tiered.close()
    events = sorted((c.step, c.tier) for c in seen)
    assert events == [(1, "local"), (2, "durable"), (2, "local")]
    durable = next(c for c in seen if c.tier == "durable")
    assert durable.uri == CheckpointStore(str(tmp_path / "durable"), check_writable=False).url(2)
    assert torch.load(durable.path)["w"].tolist() == [2.0, 2.0, 2.0]


def test_the_record_pickles_and_hashes_so_it_can_go_to_another_process(tmp_path):
    import pickle

    seen: list[Committed] = []
    with AsyncCheckpointer(CheckpointStore(str(tmp_path))) as ckpt:
        ckpt.add_commit_callback(seen.append)
        ckpt.save(1, {"w": torch.ones(2)}, extra={"metrics": {"loss": 1.5}})
    (record,) = seen
    assert pickle.loads(pickle.dumps(record)) == record
    assert hash(record) == hash(pickle.loads(pickle.dumps(record)))
