"""Accelerate integration with a real ``Accelerator`` on CPU: both paths against accelerate's own ``save_state``.

Run as a script (``python tests/accelerate/test_accelerate.py OUT_DIR``) it is one rank of the two-process test.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from lightning_async_ckpt.accelerate import INCOMPLETE_MARKER, attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.core.staging import StagingJob  # noqa: E402
from lightning_async_ckpt.errors import CheckpointError, ConfigError, ManifestError, TornSnapshotError  # noqa: E402
from tests.helpers.accelerate_runs import Counter, Run, make_run, reset_accelerate, train  # noqa: E402, F401
from tests.helpers.dist import launch_ranks  # noqa: E402
from tests.helpers.models import assert_same  # noqa: E402


def layout(folder: Path) -> dict[str, Any]:
    """Every file accelerate would load from ``folder``, loaded (safetensors keys sorted)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        path = folder / name
        if name == "manifest.json" or name.startswith("."):
            continue
        if name.endswith(".safetensors"):
            out[name] = dict(sorted(load_file(str(path)).items()))
        else:
            out[name] = torch.load(path, map_location="cpu", weights_only=False)
    return out


def snapshot(run: Run) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in run.model.state_dict().items()},
        "optimizer": copy.deepcopy(run.opt.state_dict()),
        "scheduler": copy.deepcopy(run.sched.state_dict()),
        "counter": run.counter.n,
        "rng": torch.get_rng_state(),
    }


def sync_reference(tmp_path: Path, steps: int = 3) -> Path:
    ref = make_run()
    train(ref, steps)
    ref.acc.save_state(str(tmp_path / "sync"))
    return tmp_path / "sync"


# -- hook path ---------------------------------------------------------------------------------------------
def test_hook_path_commits_what_sync_save_state_writes(tmp_path):
    sync = sync_reference(tmp_path)
    run = make_run()
    ckpt = attach(run.acc)
    train(run, 3)
    run.acc.save_state(str(tmp_path / "async"))
    folder = tmp_path / "async"
    # accelerate's part returned, but nothing told us yet: not committed, and marked as such.
    assert not (folder / "manifest.json").exists()
    assert (folder / INCOMPLETE_MARKER).exists()
    train(run, 2)  # the first step confirms the folder; the weights were staged before its update
    ckpt.close()

    assert (folder / "manifest.json").exists() and not (folder / INCOMPLETE_MARKER).exists()
    assert_same(layout(sync), layout(folder), "async")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(o["name"] for o in manifest["objects"]) == sorted(layout(sync))
    fences = {r["category"]: r["fence"] for r in manifest["plan"]["rows"]}
    assert fences["parameter"] == "optimizer_step"  # proven and deferred
    assert fences["buffer"] == "cut"
    assert manifest["step"] == 3


def test_fence_holds_the_update_until_the_weights_are_staged(tmp_path, monkeypatch):
    gate = threading.Event()
    original = StagingJob.run

    def gated(self):
        gate.wait()
        original(self)

    monkeypatch.setattr(StagingJob, "run", gated)
    # Staging starts only when the update is imminent: the fence itself opens the gate, then waits for the copy.
    # (An optimizer step pre-hook would do it too, but the proof sees such a hook and copies the weights at the cut.)
    original_wait = StagingJob.wait

    def fence(self, which):
        if saved.is_set():
            gate.set()
        return original_wait(self, which)

    monkeypatch.setattr(StagingJob, "wait", fence)
    run = make_run()
    saved = threading.Event()
    ckpt = attach(run.acc)
    train(run, 2)
    at_cut = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.acc.save_state(str(tmp_path / "async"))
    saved.set()
    handle = ckpt.handles[-1]
    assert handle.record.deferred_bytes > 0  # the weights are deferred behind the optimizer-step fence
    assert not handle.staged.done()  # staging is gated: the weights still alias the model
    train(run, 1)  # without the fence this update would race the copy (and the guard would refuse the save)
    ckpt.close()
    from safetensors.torch import load_file

    assert handle.result().step == 2
    written = load_file(str(tmp_path / "async" / "model.safetensors"))
    assert_same(dict(sorted(at_cut.items())), dict(sorted(written.items())), "weights")
    assert not torch.equal(written["0.weight"], run.model.state_dict()["0.weight"])  # the model did move on


def test_weights_written_after_the_cut_refuse_the_save(tmp_path, monkeypatch):
    gate = threading.Event()
    original = StagingJob.run
    monkeypatch.setattr(StagingJob, "run", lambda self: (gate.wait(), original(self)))
    run = make_run()
    ckpt = attach(run.acc)
    train(run, 2)
    run.acc.save_state(str(tmp_path / "async"))
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)  # user code writing the weights before the next update: the proof does not hold
    gate.set()
    train(run, 1)
    handle = ckpt.handles[-1]
    ckpt.close()
    assert isinstance(handle.committed.exception(), TornSnapshotError)
    assert not (tmp_path / "async" / "manifest.json").exists()
    with attach(run.acc), pytest.raises(CheckpointError, match="uncommitted"):
        run.acc.load_state(str(tmp_path / "async"))


def test_a_final_save_state_is_copied_at_the_cut_so_writes_after_the_loop_never_reach_it(tmp_path, monkeypatch):
    # The staging thread is held until after the write, through .data (no version bump): a deferred save would be
    # refused (or, with the sampled guard, commit the written weights); the final one holds the cut's.
    gate = threading.Event()
    original = StagingJob.run
    monkeypatch.setattr(StagingJob, "run", lambda self: (gate.wait(), original(self)))
    sync = sync_reference(tmp_path)
    run = make_run()
    uri = str(tmp_path / "store")
    ckpt = attach(run.acc, uri)
    train(run, 3)
    handle = save_state(run.acc, uri, final=True)
    with torch.no_grad():
        for p in run.model.parameters():
            p.data.mul_(2.0)  # after the training loop
    gate.set()
    ckpt.close()
    manifest = handle.result()
    assert {r["fence"] for r in manifest.plan["rows"]} == {"cut"}
    assert any("ends training" in r["rule"] for r in manifest.plan["rows"])
    assert_same(layout(sync), layout(tmp_path / "store" / "step-00000003"), "final")


class Exploding(Counter):
    armed = False

    def state_dict(self) -> dict[str, int]:
        if self.armed:
            raise RuntimeError("boom")
        return super().state_dict()


def test_a_save_state_that_failed_after_the_hook_is_never_committed(tmp_path):
    run = make_run()
    bad = Exploding()
    run.acc.register_for_checkpointing(bad)
    ckpt = attach(run.acc)
    train(run, 1)
    bad.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        run.acc.save_state(str(tmp_path / "async"))  # accelerate fails after our hook took the weights
    with pytest.raises(CheckpointError, match="custom_checkpoint_1.pkl"):
        ckpt.close()
    assert not (tmp_path / "async" / "manifest.json").exists()
    assert (tmp_path / "async" / INCOMPLETE_MARKER).exists()


def test_an_unconfirmed_folder_is_refused_by_load_state(tmp_path):
    run = make_run()
    ckpt = attach(run.acc)
    train(run, 1)
    run.acc.save_state(str(tmp_path / "async"))
    shutil.copytree(tmp_path / "async", tmp_path / "copy")  # what a crash right now would leave
    with pytest.raises(CheckpointError, match="uncommitted"):
        run.acc.load_state(str(tmp_path / "copy"))
    with pytest.raises(CheckpointError, match="uncommitted"):
        load_state(run.acc, str(tmp_path / "copy"))  # never an uncommitted generation, and never silently
    run.acc.load_state(str(tmp_path / "async"))  # waits for its own in-flight save, then loads it
    ckpt.close()


def test_saving_into_the_same_folder_again_recommits_it(tmp_path):
    run = make_run()
    ckpt = attach(run.acc)
    train(run, 2)
    run.acc.save_state(str(tmp_path / "latest"))
    train(run, 2)
    expected = snapshot(run)
    run.acc.save_state(str(tmp_path / "latest"))
    ckpt.close()
    manifest = json.loads((tmp_path / "latest" / "manifest.json").read_text())
    assert manifest["step"] == 4
    resumed = make_run(seed=99)
    assert load_state(resumed.acc, str(tmp_path / "latest")).step == 4  # a committed folder loads directly
    assert_same(expected["model"], resumed.model.state_dict(), "model")
    assert resumed.counter.n == 4


def test_fsdp_and_deepspeed_get_a_clear_error(tmp_path, monkeypatch):
    run = make_run()
    run.acc.register_save_state_pre_hook(lambda models, weights, out: weights.clear())  # like FSDP: no weights
    ckpt = attach(run.acc)
    with pytest.raises(ConfigError, match="FSDP, DeepSpeed"):
        run.acc.save_state(str(tmp_path / "x"))
    ckpt.close()
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.FSDP))
    with pytest.raises(ConfigError, match="FSDP"):
        attach(run.acc)


def test_attach_validates_and_is_idempotent(tmp_path):
    run = make_run()
    with pytest.raises(ConfigError, match="coalesce"):
        attach(run.acc, admission="coalesce")
    ckpt = attach(run.acc, str(tmp_path / "store"))
    assert attach(run.acc) is ckpt
    with pytest.raises(ConfigError, match="already has a checkpointer"):
        attach(run.acc, str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="uri="):
        save_state(run.acc, str(tmp_path / "other"))
    ckpt.close()
    assert attach(run.acc) is not ckpt
    attach(run.acc).close()


# -- fully asynchronous path -------------------------------------------------------------------------------
def test_full_async_save_matches_sync_and_resumes_identically(tmp_path):
    sync = sync_reference(tmp_path)
    run = make_run()
    uri = str(tmp_path / "store")
    ckpt = attach(run.acc, uri)
    train(run, 3)
    handle = save_state(run.acc, uri)  # step 3: the optimizer updates seen
    run.acc.save_state(str(tmp_path / "hook"))
    train(run, 2)
    ckpt.close()
    manifest = handle.result()
    assert manifest.step == 3
    generation = tmp_path / "store" / "step-00000003"
    assert_same(layout(sync), layout(generation), "generation")
    fences = {r["category"]: r["fence"] for r in manifest.plan["rows"]}
    assert fences["parameter"] == fences["optimizer_state"] == "optimizer_step"

    resumed = {}
    for name, restore in (
        ("accelerate", lambda r: r.acc.load_state(str(sync))),
        ("ours", lambda r: load_state(r.acc, uri)),
        ("hook", lambda r: r.acc.load_state(str(tmp_path / "hook"))),
    ):
        r = make_run(seed=123)  # different init and RNG: everything must come from the checkpoint
        restore(r)
        train(r, 3)
        resumed[name] = snapshot(r)
    assert_same(resumed["accelerate"], resumed["ours"], "ours")
    assert_same(resumed["accelerate"], resumed["hook"], "hook")


def test_load_state_picks_the_newest_committed_generation(tmp_path):
    uri = str(tmp_path / "store")
    run = make_run()
    ckpt = attach(run.acc, uri, keep_last=None)
    assert load_state(run.acc, uri) is None
    train(run, 2)
    at_2 = snapshot(run)
    save_state(run.acc, uri)
    train(run, 2)
    save_state(run.acc, uri)
    ckpt.close()
    os.unlink(tmp_path / "store" / "step-00000004" / "manifest.json")  # a save that never committed
    resumed = make_run(seed=5)
    assert load_state(resumed.acc, uri).step == 2
    assert_same(at_2["model"], resumed.model.state_dict(), "model")
    with pytest.raises(ManifestError):
        load_state(resumed.acc, uri, step=4)


def test_full_async_save_to_s3_loads_back(tmp_path, s3_uri):
    uri, storage_options = s3_uri
    run = make_run()
    ckpt = attach(run.acc, uri, storage_options=storage_options)
    train(run, 2)
    expected = snapshot(run)
    handle = save_state(run.acc, uri)
    train(run, 1)
    ckpt.close()
    assert handle.result().step == 2
    assert CheckpointStore(uri, storage_options, check_writable=False).verify(2).ok
    resumed = make_run(seed=7)
    assert load_state(resumed.acc, uri, storage_options=storage_options).step == 2
    assert_same(expected, snapshot(resumed), "resumed")


# -- two processes -----------------------------------------------------------------------------------------
def _launch(out: Path, mode: str) -> list[dict[str, Any]]:
    """Run this file as two ranks (gloo on CPU); return each rank's JSON result line."""
    results = []
    for proc in launch_ranks([sys.executable, __file__, str(out), mode], timeout=90):
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{"))))
    return results


@pytest.mark.slow
def test_two_processes_write_one_generation_that_both_reload(tmp_path):
    results = _launch(tmp_path, "ok")
    assert [r["committed_step"] for r in results] == [3, 3]  # rank 1's handle resolved at close()
    assert all(r["resume_equal"] for r in results)
    sync = layout(tmp_path / "sync")
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(sync)
    assert not torch.equal(
        sync["random_states_0.pkl"]["torch_manual_seed"], sync["random_states_1.pkl"]["torch_manual_seed"]
    )
    assert_same(sync, layout(tmp_path / "store" / "step-00000003"), "generation")
    assert_same(sync, layout(tmp_path / "hook"), "hook")
    assert (tmp_path / "hook" / "manifest.json").exists()


@pytest.mark.slow
def test_two_processes_raise_a_failed_upload_on_every_rank(tmp_path):
    results = _launch(tmp_path, "fail")
    assert "refuses to be pickled" in results[0]["close_error"]
    assert "failed on another rank (rank 0:" in results[1]["close_error"]
    store = CheckpointStore(str(tmp_path / "store"), check_writable=False)
    assert store.generations() == []  # nothing was committed


class _Unpicklable:
    """Deep-copies fine at the cut, fails when the upload thread serializes it."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


class Poisoned(Counter):
    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "poison": _Unpicklable()}


def _worker(out: str, mode: str) -> None:
    """One rank. ``ok``: sync, hook and fully asynchronous saves at one cut; train on; reload and compare.
    ``fail``: the main process's background upload fails; every rank must raise it at close()."""
    run = make_run()
    rank = run.acc.process_index
    if mode == "fail":
        run.acc.register_for_checkpointing(Poisoned() if rank == 0 else Counter())
        ckpt = attach(run.acc, f"{out}/store")
        train(run, 2)
        save_state(run.acc, f"{out}/store")
        train(run, 1)
        try:
            ckpt.close()
            error = None
        except CheckpointError as exc:
            error = str(exc)
        print(json.dumps({"rank": rank, "close_error": error}))
        return
    torch.manual_seed(1 + rank)  # ranks' RNG states differ, so their files must not mix up
    train(run, 3)
    run.acc.save_state(f"{out}/sync")
    ckpt = attach(run.acc, f"{out}/store")
    ckpt.step = 3
    run.acc.save_state(f"{out}/hook")
    handle = save_state(run.acc, f"{out}/store")
    train(run, 2)
    ckpt.close()
    run.acc.load_state(f"{out}/sync")
    expected = snapshot(run)
    train(run, 1)
    load_state(run.acc, f"{out}/store")
    try:
        assert_same(expected, snapshot(run))
        equal = True
    except AssertionError:
        equal = False
    print(json.dumps({"rank": rank, "committed_step": handle.result(0).step, "resume_equal": equal}))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
