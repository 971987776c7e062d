"""A load in a process with its own saves in flight waits for them; accelerate's save pre-hooks and automatic naming
with the library's own ``save_state``; ``model.load_state_dict`` after a save is fenced.

Saves are held in flight by a real object whose pickling (on the upload thread) waits on a ``threading.Event``; the
test releases it from another thread once the reader logged that it waits.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.core.engine import AsyncCheckpointer  # noqa: E402
from lightning_async_ckpt.core.staging import StagingJob  # noqa: E402
from lightning_async_ckpt.lightning import latest_checkpoint  # noqa: E402
from tests.helpers.accelerate_runs import make_run, reset_accelerate, train  # noqa: E402, F401

LOG = "lightning_async_ckpt"


class _HeldUpload:
    """Pickled on the upload thread: waits for ``release`` first. Deep copies (the cut) are the object itself."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def __deepcopy__(self, memo: dict) -> _HeldUpload:
        return self

    def __reduce__(self) -> Any:
        assert self.release.wait(60), "the held save was never released"
        return (collections.OrderedDict, ())


class _Holder:
    """A checkpointed object (``custom_checkpoint_i.pkl``) whose next save stays in flight until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()

    def hold(self) -> threading.Event:
        self.release = threading.Event()
        return self.release

    def state_dict(self) -> dict[str, Any]:
        return {"held": _HeldUpload(self.release)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _ReleaseWhenWaiting(logging.Handler):
    """Releases ``release`` once a reader logs that it waits for saves in flight (from the logging call)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.gate = release
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "still in flight" in message:
            self.seen.append(message)
            self.gate.set()


def _waiting_releases(release: threading.Event) -> _ReleaseWhenWaiting:
    handler = _ReleaseWhenWaiting(release)
    logger = logging.getLogger(LOG)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


@pytest.fixture
def waiting_log():
    handlers: list[logging.Handler] = []

    def install(release: threading.Event) -> _ReleaseWhenWaiting:
        handlers.append(_waiting_releases(release))
        return handlers[-1]  # type: ignore[return-value]

    yield install
    for h in handlers:
        logging.getLogger(LOG).removeHandler(h)


# -- a load waits for this process's saves in flight ---------------------------------------------------------
def test_load_state_waits_for_its_own_save_in_flight_instead_of_loading_an_older_one(tmp_path, waiting_log):
    uri = str(tmp_path / "store")
    run = make_run()
    holder = _Holder()
    run.acc.register_for_checkpointing(holder)
    ckpt = attach(run.acc, uri)
    train(run, 1)
    save_state(run.acc, uri).result()  # step 1, committed
    train(run, 1)
    handler = waiting_log(holder.hold())
    handle = save_state(run.acc, uri)  # step 2 stays in flight until the reader waits
    assert not handle.done
    manifest = load_state(run.acc, uri)
    assert manifest is not None and manifest.step == 2  # not step 1: the newest save landed first
    assert handler.seen and "steps [2]" in handler.seen[0]
    ckpt.close()


def test_another_accelerator_in_the_same_process_waits_for_the_first_ones_save(tmp_path, waiting_log):
    uri = str(tmp_path / "store")
    first = make_run()
    holder = _Holder()
    first.acc.register_for_checkpointing(holder)
    ckpt = attach(first.acc, uri)
    train(first, 2)
    handler = waiting_log(holder.hold())
    handle = save_state(first.acc, uri)  # the only generation, in flight
    second = make_run(seed=5)
    second.acc.register_for_checkpointing(_Holder())
    manifest = load_state(second.acc, uri)  # no checkpointer attached to this one
    assert manifest is not None and manifest.step == 2  # not None ("nothing to load")
    assert handle.done and handler.seen
    ckpt.close()


def test_a_plain_loop_store_latest_and_resume_wait_for_the_engine_of_this_process(tmp_path, waiting_log):
    uri = str(tmp_path / "plain")
    release = threading.Event()
    engine = AsyncCheckpointer(CheckpointStore(uri))
    handler = waiting_log(release)
    handle = engine.save(7, {"w": torch.ones(3), "held": _HeldUpload(release)})
    info = CheckpointStore(uri, check_writable=False).latest()  # a reader that never met the engine
    assert info is not None and info.step == 7 and handle.done and handler.seen
    release2 = threading.Event()
    handler.gate = release2
    engine.save(8, {"w": torch.ones(3), "held": _HeldUpload(release2)})
    resumed = CheckpointStore(uri, check_writable=False).resume(step=8)
    assert resumed is not None and resumed.step == 8
    engine.close()


def test_latest_checkpoint_waits_for_a_save_of_this_process_in_flight(tmp_path, waiting_log):
    dirpath = str(tmp_path / "lightning")
    release = threading.Event()
    engine = AsyncCheckpointer(CheckpointStore(dirpath))
    handler = waiting_log(release)
    engine.save(3, {"state_dict": {"w": torch.ones(2)}, "held": _HeldUpload(release)})
    path = latest_checkpoint(dirpath)
    assert path is not None and "step-00000003" in path and handler.seen
    engine.close()


def test_a_save_still_in_flight_after_the_bound_is_an_error_never_an_older_generation(tmp_path):
    from lightning_async_ckpt.errors import CheckpointError
    from lightning_async_ckpt.storage import inflight

    uri = str(tmp_path / "plain")
    release = threading.Event()
    engine = AsyncCheckpointer(CheckpointStore(uri))
    engine.save(1, {"w": torch.ones(1)}).result()
    engine.save(2, {"w": torch.ones(1), "held": _HeldUpload(release)})
    with pytest.raises(CheckpointError, match=r"steps \[2\].*still in flight"):
        inflight.wait_for(uri, timeout_s=0.05, doing="latest()")
    release.set()
    engine.close()


def test_only_saves_at_inside_or_around_the_location_are_waited_for(tmp_path):
    from lightning_async_ckpt.storage import inflight

    release = threading.Event()
    engine = AsyncCheckpointer(CheckpointStore(str(tmp_path / "runs" / "v1")))
    engine.save(1, {"w": torch.ones(1), "held": _HeldUpload(release)})
    assert inflight.pending(str(tmp_path / "runs"))  # around it (a dirpath and its version folders)
    assert inflight.pending(str(tmp_path / "runs" / "v1" / "step-00000001"))  # inside it (one generation)
    assert not inflight.pending(str(tmp_path / "runs2"))  # a sibling sharing the prefix
    assert not inflight.pending(str(tmp_path / "runs" / "v10"))
    release.set()
    engine.close()
    assert not inflight.pending(str(tmp_path / "runs"))  # forgotten once the save ended


# -- accelerate's save-state pre-hooks -----------------------------------------------------------------------
def test_save_state_runs_the_save_pre_hooks_like_accelerate_and_commits_what_they_write(tmp_path):
    uri = str(tmp_path / "store")
    run = make_run()
    seen: dict[str, Any] = {}

    def save_config(models: list, weights: list, output_dir: str) -> None:
        seen.update(models=models, keys=[sorted(w) for w in weights], output_dir=output_dir)
        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump({"class_name": type(models[0]).__name__}, f)

    def load_config(models: list, input_dir: str) -> None:
        with open(os.path.join(input_dir, "data.json")) as f:
            seen["loaded"] = json.load(f)["class_name"]

    run.acc.register_save_state_pre_hook(save_config)
    run.acc.register_load_state_pre_hook(load_config)
    ckpt = attach(run.acc, uri)
    train(run, 1)
    manifest = save_state(run.acc, uri).result()
    assert seen["models"] is run.acc._models
    assert seen["keys"] == [sorted(run.acc.get_state_dict(run.model, unwrap=False))]
    assert "data.json" in {o.name for o in manifest.objects}
    load_state(run.acc, uri)
    assert seen["loaded"] == "Sequential"
    ckpt.close()
    assert not os.path.exists(seen["output_dir"])  # the hooks' folder is gone once the save ended


def test_a_save_pre_hook_that_takes_the_weights_leaves_them_out_as_accelerate_does(tmp_path):
    uri = str(tmp_path / "store")
    run = make_run()
    run.acc.register_save_state_pre_hook(lambda models, weights, output_dir: weights.pop(0))
    ckpt = attach(run.acc, uri)
    manifest = save_state(run.acc, uri).result()
    assert "model.safetensors" not in {o.name for o in manifest.objects}
    ckpt.close()


# -- model.load_state_dict right after a save ----------------------------------------------------------------
def test_load_state_dict_after_save_state_waits_for_the_weights_to_be_staged(tmp_path, monkeypatch):
    gate = threading.Event()
    original = StagingJob.run
    monkeypatch.setattr(StagingJob, "run", lambda self: (gate.wait(), original(self)))
    uri = str(tmp_path / "store")
    run = make_run()
    # Registered before attach(), so it runs before our fence: staging starts only when the overwrite is imminent.
    run.model.register_load_state_dict_pre_hook(lambda *_: gate.set())
    ckpt = attach(run.acc, uri)
    train(run, 2)
    at_cut = {k: v.clone() for k, v in run.model.state_dict().items()}
    handle = save_state(run.acc, uri)
    assert not handle.staged.done()
    other = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    run.model.load_state_dict(other.state_dict())  # what accelerate's test_save_load_model does
    assert handle.result().step == 2  # not refused as a torn snapshot
    load_state(run.acc, uri)
    for k, v in at_cut.items():
        assert torch.equal(run.model.state_dict()[k], v), k
    ckpt.close()


# -- automatic checkpoint naming with the library's own save_state -------------------------------------------
def _automatic(tmp_path: Path, **config: Any) -> tuple[Accelerator, torch.nn.Module, Any]:
    reset_accelerate()
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, **config)
    acc = Accelerator(cpu=True, project_config=project)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc: Accelerator, model: torch.nn.Module, opt: Any) -> None:
    loss = model(torch.randn(4, 3)).sum()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def test_save_state_without_uri_follows_accelerates_automatic_naming_and_total_limit(tmp_path):
    acc, model, opt = _automatic(tmp_path, total_limit=1)  # refused by attach() before: it is safe here
    ckpt = attach(acc)
    handles = []
    for _ in range(3):
        _step(acc, model, opt)
        handles.append(save_state(acc))
    assert acc.project_configuration.iteration == 3
    ckpt.close()
    assert [h.result().extra["output_dir"].rsplit("/", 1)[-1] for h in handles] == [
        "checkpoint_0",
        "checkpoint_1",
        "checkpoint_2",
    ]
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert "checkpoint_2" in names and "checkpoint_0" not in names  # older ones removed once a newer committed
    assert load_state(acc).step == 3


def test_total_limit_never_removes_a_folder_still_being_written(tmp_path):
    acc, model, opt = _automatic(tmp_path, total_limit=1)
    holder = _Holder()
    acc.register_for_checkpointing(holder)
    ckpt = attach(acc, max_outstanding=2)
    release = holder.hold()
    first = save_state(acc)  # checkpoint_0 in flight
    holder.release = threading.Event()
    holder.release.set()
    _step(acc, model, opt)
    second = save_state(acc)  # total_limit=1 would delete checkpoint_0 here
    assert os.path.isdir(tmp_path / "checkpoints" / "checkpoint_0")
    release.set()
    assert first.result() is not None and second.result() is not None
    ckpt.close()
    from lightning_async_ckpt.accelerate.folders import accelerate_folders, verify_accelerate_folder

    for folder in accelerate_folders(str(tmp_path / "checkpoints")) or []:
        if folder.committed:
            assert verify_accelerate_folder(folder) == []


def test_save_state_without_uri_needs_automatic_naming(tmp_path):
    from lightning_async_ckpt.errors import ConfigError

    run = make_run()
    with pytest.raises(ConfigError, match="automatic_checkpoint_naming"):
        save_state(run.acc)
