"""Soak: 500 checkpoints in one run; memory and threads stay flat, every request is accounted for.

A plain PyTorch loop (the framework-free core, with ``attach`` fences) saves at every step: with
``admission="wait"`` all 500 commit; with ``admission="skip"`` requests arriving while a save is in flight are
skipped and must be counted as such.

How many saves a busy machine finishes between steps is not the test's business: in ``skip`` mode every request is
checked against what admission saw (skipped exactly when a save was outstanding, committed exactly when admitted),
every tenth request comes after a drain and must commit, and at a few gated steps the save is held in storage
(a ``threading.Event``) while the next requests arrive, which must be skipped.
"""

from __future__ import annotations

import gc
import threading
from collections import Counter

import psutil
import pytest
import torch
from torch import nn

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.storage.generation import generation_name
from lightning_async_ckpt.testing import Fault

pytestmark = pytest.mark.slow

STEPS = 500
WARMUP = 50
KEEP_LAST = 3
# One checkpoint is ~1.6 MiB (weights + Adam moments); retaining even a tenth of them would exceed this.
RSS_TOLERANCE = 48 << 20
STATE_ENTRIES = ("model", "optim", "step")
# skip: a drain before every DRAIN_EVERY-th request (it must commit); at each GATED step the save is held in its
# first storage write while the next HELD requests arrive (they must be skipped).
DRAIN_EVERY = 10
GATED = (100, 250, 400)  # drained first, so admitted
HELD = 3


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _snapshot() -> tuple[int, int, int]:
    gc.collect()
    proc = psutil.Process()
    return proc.memory_info().rss, threading.active_count(), proc.num_threads()


@pytest.mark.parametrize("admission", ["wait", "skip"])
def test_500_checkpoints_memory_threads_accounting_and_retention(tmp_path, admission):
    torch.set_num_threads(1)
    model, opt = _model()
    x = torch.randn(32, 256)
    gates = {step: (threading.Event(), threading.Event()) for step in GATED} if admission == "skip" else {}
    faults = [
        Fault(op="write", path=generation_name(step) + "/", stall=release, callback=lambda _c, e=entered: e.set())
        for step, (entered, release) in gates.items()
    ]
    root = tmp_path / "ckpt"
    store = CheckpointStore(f"faulty://{root}", {"target_protocol": "file", "faults": faults}) if faults else None
    store = store or CheckpointStore(str(root))
    ckpt = AsyncCheckpointer(store, admission=admission, keep_last=KEEP_LAST, retries=0)
    ckpt.attach(model, opt)
    warm = warm_pool = None
    held: list[int] = []
    try:
        for step in range(1, STEPS + 1):
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            if admission == "skip" and step % DRAIN_EVERY == 0:
                ckpt.drain()
            handle = ckpt.save(
                step,
                {"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                modules=[model],
                optimizers=[opt],
            )
            if admission == "skip" and step % DRAIN_EVERY == 0:
                assert handle.decision.admitted, (
                    f"step {step} was requested with nothing outstanding: {handle.decision}"
                )
            if step in gates:
                assert gates[step][0].wait(60), f"step {step}'s save never reached storage"
            if any(0 < step - g <= HELD for g in gates):
                held.append(step)
                if step - HELD in gates:
                    gates[step - HELD][1].set()
            if step == WARMUP:
                ckpt.drain()
                warm, warm_pool = _snapshot(), ckpt.pool.retained_bytes
        ckpt.drain()
        end, end_pool = _snapshot(), ckpt.pool.retained_bytes
    finally:
        for _, release in gates.values():
            release.set()
        ckpt.close()

    # Memory and threads are flat after warm-up.
    assert end[0] - warm[0] < RSS_TOLERANCE, f"RSS grew {(end[0] - warm[0]) / 2**20:.1f} MiB over {STEPS} saves"
    assert end[1] == warm[1], "Python threads changed"
    assert abs(end[2] - warm[2]) <= 2, "OS threads changed"
    assert end_pool == warm_pool > 0, "staging buffers are reused, not grown"

    # Every requested cut is accounted for.
    records = list(ckpt.records)
    outcomes = Counter(r.outcome for r in records)
    assert len(records) == STEPS and sorted(r.requested_step for r in records) == list(range(1, STEPS + 1))
    assert outcomes["committed"] + outcomes["skipped"] + outcomes["aborted"] == STEPS, outcomes
    if admission == "wait":
        assert outcomes["committed"] == STEPS, outcomes  # 500 real checkpoints
    else:
        # Skipped exactly when a save was outstanding; every admitted save committed.
        for r in records:
            assert (r.decision == "skip") == (r.backlog >= 1), r
            assert r.outcome == ("skipped" if r.decision == "skip" else "committed"), r
        by_step = {r.requested_step: r for r in records}
        drained = list(range(DRAIN_EVERY, STEPS + 1, DRAIN_EVERY))
        assert all(by_step[s].outcome == "committed" for s in drained), "a request after a drain was not admitted"
        assert all(by_step[s].outcome == "committed" for s in GATED)
        assert len(held) == len(GATED) * HELD and all(by_step[s].outcome == "skipped" for s in held), held
        assert outcomes["committed"] >= len(drained) and outcomes["skipped"] >= len(held), outcomes
    events = Counter(e["event"] for e in ckpt.events.events)
    assert events["request"] == STEPS and events["save"] == STEPS
    assert events["committed"] == outcomes["committed"] and events["failed"] == 0

    # Retention keeps exactly keep_last generations: the newest commits, and no leftovers.
    committed = sorted(r.requested_step for r in records if r.outcome == "committed")
    gens = store.generations(include_uncommitted=True)
    assert [g.step for g in gens] == committed[-KEEP_LAST:]
    assert all(g.committed for g in gens)
    assert store.verify(committed[-1]).ok
    last = torch.load(store.open(committed[-1], "checkpoint.ckpt"), weights_only=True)
    assert tuple(last) == STATE_ENTRIES and last["step"] == committed[-1]
