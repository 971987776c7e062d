"""One rank of the resume-once tests: 2 CPU ranks (gloo), every filesystem call of each rank counted.

Usage: ``python resume_once_worker.py <store> <mode>...`` under ``tests.helpers.dist.launch_ranks``; the store
holds committed generations already. Runs each mode in turn and prints one ``RESULT {json}``: per mode, what the rank
found (or the error it raised) and the calls it made:

- ``latest``: ``latest_checkpoint`` on both ranks (the default group is gloo);
- ``latest_error``: the same, with rank 0's listing failing: every rank must raise its error;
- ``last``: a real DDP ``Trainer``'s ``ckpt_path="last"`` lookup (``find_last``, ``trainer.strategy.broadcast``);
- ``committed``: ``committed_steps_once`` (what ``setup_sharded`` can call instead of listing on every rank);
- ``latest_store``: ``latest_once`` of a store (the plain-loop ``CheckpointStore.latest()``).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import (  # noqa: E402
    OPS,
    Fault,
    FaultCall,
    register_faulty,
)

register_faulty()  # this process names faulty:// URLs

CALLS: Counter[str] = Counter()


def _count(call: FaultCall) -> None:
    CALLS[call.op] += 1
    if call.path.endswith("manifest.json") and call.op in ("cat_file", "open"):
        CALLS["manifest_reads"] += 1


def _options(fail_listing: bool) -> dict:
    faults = [Fault(op=op, times=None, callback=_count) for op in OPS if op not in ("write", "read", "close")]
    if fail_listing:
        faults.append(Fault(op="ls", times=None, error="oserror"))
    return {"target_protocol": "file", "faults": faults}


def _trainer():
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, max_steps=1
    )


def run(store: str, mode: str, rank: int) -> dict:
    """One mode on this rank: what it found (or raised) and the filesystem calls it made."""
    CALLS.clear()
    uri = f"faulty://{store}"
    options = _options(fail_listing=mode == "latest_error" and rank == 0)
    result: dict = {}
    try:
        if mode in ("latest", "latest_error"):
            from lightning_async_ckpt import latest_checkpoint

            result["found"] = latest_checkpoint(uri, options)
        elif mode == "last":
            from lightning_async_ckpt import AsyncCheckpointCallback
            from lightning_async_ckpt.lightning.resume import find_last

            callback = AsyncCheckpointCallback(dirpath=uri, every_n_train_steps=1, storage_options=options)
            trainer = _trainer()
            result["world_size"] = trainer.world_size
            found = find_last(callback, trainer)
            reader = callback._lightning_async_ckpt_reader
            result["found"] = sorted(reader.resolve(p) or p for p in found)
        elif mode == "committed":
            from lightning_async_ckpt.lightning.resume import committed_steps_once

            steps = committed_steps_once(CheckpointStore(uri, options, check_writable=False), _trainer())
            result["found"] = sorted(steps)
        elif mode == "latest_store":
            from lightning_async_ckpt.sharded.once import latest_once

            info = latest_once(CheckpointStore(uri, options, check_writable=False))
            result["found"] = None if info is None else [info.step, info.run_id]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = [type(exc).__name__, str(exc).split("\n")[0]]
    result["calls"] = dict(CALLS)
    return result


def main(store: str, modes: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank, **{mode: run(store, mode, rank) for mode in modes}}
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
