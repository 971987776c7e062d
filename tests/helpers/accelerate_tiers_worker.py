"""One process of a two-process Accelerate run with two tiers, launched by tests/accelerate/test_accelerate_tiers_ddp.py.

Usage: python accelerate_tiers_worker.py BASE
    Both phases run in this one pair of processes, one after the other. ``train``: 10 steps, ``save_state`` after each (local every 2, promoted every 4) into the local folder both
    processes share (one node); process 1 receives a real SIGUSR1 after step 9, so step 9 is the emergency save on
    both. Then process 0 copies the shared folder to ``local-damaged`` and changes the last 4 bytes of its step 9's
    ``model.safetensors`` (same size). ``resume``: ``load_state`` with the shared folder (both resume locally), then with a folder of its own
    per process (process 1's is empty: both fall back to ``uri`` together), then with process 1 on a copy whose step 9
    is damaged (its newest intact is 8, older than ``uri``'s 9: both load ``uri``).
Prints ``RESULT <phase> {json}`` after each phase.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402


def _loaded(manifest) -> dict:
    return {"step": manifest.step, "promoted": PROMOTED_FROM_KEY in manifest.extra} if manifest else {}


def _train(base: str) -> dict:
    run = make_run()
    rank = run.acc.process_index
    report: dict = {"rank": rank}
    ckpt = attach(
        run.acc,
        f"{base}/durable",
        local_dirpath=f"{base}/local",
        local_every_n_train_steps=2,
        every_n_train_steps=4,
        preemption_signal=signal.SIGUSR1,
        preemption_grace_s=120,
    )
    for step in range(1, 11):
        train(run, 1)
        if step == 9 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only process 1 is signalled
        save_state(run.acc)
        if ckpt.preempted:
            report["stopped"] = step
            break
    report["promoted_step"] = ckpt.promoted_step
    ckpt.close()
    return report


def _damage(base: str) -> None:
    shutil.copytree(f"{base}/local", f"{base}/local-damaged")
    with open(f"{base}/local-damaged/step-00000009/model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")  # same size, other bytes: only re-reading against the checksum tells


def _resume(base: str) -> dict:
    durable, shared = f"{base}/durable", f"{base}/local"
    run = make_run()
    rank = run.acc.process_index
    report: dict = {"rank": rank}
    report["shared"] = _loaded(load_state(run.acc, durable, local_dirpath=shared))
    own = shared if rank == 0 else f"{base}/local-{rank}"
    report["own"] = _loaded(load_state(run.acc, durable, local_dirpath=own))
    damaged = shared if rank == 0 else f"{base}/local-damaged"  # step 9 damaged in that copy
    report["damaged"] = _loaded(load_state(run.acc, durable, local_dirpath=damaged))
    return report


def main() -> None:
    base = sys.argv[1]
    print("RESULT train " + json.dumps(_train(base)), flush=True)
    dist.barrier()  # both processes closed their checkpointers
    if dist.get_rank() == 0:
        _damage(base)
    dist.barrier()
    print("RESULT resume " + json.dumps(_resume(base)), flush=True)


if __name__ == "__main__":
    main()
