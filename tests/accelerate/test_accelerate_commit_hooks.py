"""Issue 43, point 1 in Accelerate: ``add_commit_callback`` on the checkpointer ``attach`` returns, both paths."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("accelerate")

from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.core.commit_hooks import CommitCallbackError, Committed  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402


def test_each_commit_of_the_fully_async_path_reaches_the_callback_on_the_training_thread(tmp_path):
    uri = str(tmp_path / "store")
    run = make_run()
    ckpt = attach(run.acc, uri)
    seen: list[tuple[Committed, bool]] = []
    ckpt.add_commit_callback(lambda c: seen.append((c, threading.current_thread() is threading.main_thread())))
    train(run, 2)
    first = save_state(run.acc, uri)
    first.committed.result()
    assert seen == []  # delivered at the next call on the training thread, not by the upload thread
    train(run, 2)  # the optimizer-step fence delivers it
    assert [c.step for c, _ in seen] == [2]
    save_state(run.acc, uri, final=True)
    ckpt.close()
    assert [c.step for c, _ in seen] == [2, 4] and all(main for _, main in seen)
    last = seen[-1][0]
    assert last.tier == "durable" and last.is_last and last.path == last.uri  # a folder of accelerate's files
    assert "model.safetensors" in last.manifest.files
    fresh = make_run(seed=1)
    assert load_state(fresh.acc, last.uri) is not None  # what it names loads


def test_hook_path_folders_are_reported_and_a_raising_callback_is_raised_once(tmp_path):
    run = make_run()
    ckpt = attach(run.acc)
    calls: list[str] = []

    def hook(committed: Committed) -> None:
        calls.append(committed.uri)
        raise OSError("registry unreachable")

    ckpt.add_commit_callback(hook)
    train(run, 2)
    run.acc.save_state(str(tmp_path / "a"))
    with pytest.raises(CommitCallbackError, match="registry unreachable"):
        ckpt.close()
    assert calls == [str(tmp_path / "a")]
    assert (tmp_path / "a" / "manifest.json").is_file()


def test_a_non_callable_is_refused(tmp_path):
    run = make_run()
    ckpt = attach(run.acc, str(tmp_path / "store"))
    with pytest.raises(TypeError, match="callable"):
        ckpt.add_commit_callback(None)  # type: ignore[arg-type]  # refused before any engine exists
    train(run, 1)
    save_state(run.acc, str(tmp_path / "store"))
    ckpt.close()  # nothing was registered: the save commits without a callback error


def test_an_exporter_refuses_a_save_state_folder_with_a_clear_error(tmp_path):
    from lightning_async_ckpt import Exporter, ExportError

    run = make_run()
    ckpt = attach(run.acc)
    exporter = Exporter()
    ckpt.add_commit_callback(exporter)
    train(run, 2)
    run.acc.save_state(str(tmp_path / "folder"))
    ckpt.close()
    with pytest.raises(ExportError, match="use attach\\(accelerator, uri\\)"):
        exporter.finish()


def test_the_fully_async_path_exports_accelerate_weights(tmp_path):
    from safetensors.torch import load_file

    from lightning_async_ckpt import Exporter

    uri = str(tmp_path / "store")
    run = make_run()
    ckpt = attach(run.acc, uri)
    exporter = Exporter()
    ckpt.add_commit_callback(exporter)
    train(run, 2)
    save_state(run.acc, uri, final=True)
    ckpt.close()
    assert exporter.finish() is True
    (manifest,) = exporter.exported
    weights = load_file(f"{uri}/exports/safetensors/step-00000002/{manifest.object('model.safetensors').key}")
    assert weights.keys() == run.acc.unwrap_model(run.model).state_dict().keys()
