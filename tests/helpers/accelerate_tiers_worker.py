"""One process of a two-process Accelerate run with two tiers, launched by tests/accelerate/test_accelerate_tiers_ddp.py.

Usage: python accelerate_tiers_worker.py BASE PHASE
    PHASE ``train``: 10 steps, ``save_state`` after each (local every 2, promoted every 4) into the local folder both
    processes share (one node); process 1 receives a real SIGUSR1 after step 9, so step 9 is the emergency save on
    both. PHASE ``resume``: ``load_state`` with the shared folder (both resume locally), then with a folder of its own
    per process (process 1's is empty: both fall back to ``uri`` together), then with process 1 on a copy whose step 9
    is damaged (its newest intact is 8, older than ``uri``'s 9: both load ``uri``).
Prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.storage.promote import PROMOTED_FROM_KEY  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402


def _loaded(manifest) -> dict:
    return {"step": manifest.step, "promoted": PROMOTED_FROM_KEY in manifest.extra} if manifest else {}


def main() -> None:
    base, phase = sys.argv[1], sys.argv[2]
    durable, shared = f"{base}/durable", f"{base}/local"
    run = make_run()
    rank = run.acc.process_index
    report: dict = {"rank": rank}
    if phase == "train":
        ckpt = attach(
            run.acc,
            durable,
            local_dirpath=shared,
            local_every_n_steps=2,
            promote_every_n_steps=4,
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
    else:
        report["shared"] = _loaded(load_state(run.acc, durable, local_dirpath=shared))
        own = shared if rank == 0 else f"{base}/local-{rank}"
        report["own"] = _loaded(load_state(run.acc, durable, local_dirpath=own))
        damaged = shared if rank == 0 else f"{base}/local-damaged"  # the test damaged step 9 in that copy
        report["damaged"] = _loaded(load_state(run.acc, durable, local_dirpath=damaged))
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
