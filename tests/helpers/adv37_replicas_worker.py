"""One rank of a 2-process gloo run for tests/tiers/test_adversarial_37.py: a plain loop with ``replicas=1`` whose
rank 0 saves steps 1..5 back to back and closes at once (no drain), then an emergency save in a second checkpointer.

Usage: python adv37_replicas_worker.py BASE. Each rank prints ``RESULT {json}``: the steps in its local folder after
each phase and rank 0's emergency report.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer  # noqa: E402


def _steps(path: str) -> list[int]:
    return [g.step for g in CheckpointStore(path, check_writable=False).generations()]


def main() -> None:
    base = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local, durable = f"{base}/local-{rank}", f"{base}/durable"
    report: dict = {}
    ckpt = TieredCheckpointer(local, durable, every_n_train_steps=100, replicas=1, ranks_per_node=1)
    if rank == 0:
        for step in range(1, 6):
            ckpt.save(step, {"step": step, "w": torch.full((1 << 16,), float(step))})
    ckpt.close()  # no drain: the newest save's replica must still reach rank 1
    dist.barrier()
    report["after_close"] = _steps(local)
    ckpt = TieredCheckpointer(local, durable, every_n_train_steps=100, replicas=1, ranks_per_node=1)
    restored = ckpt.restore()
    report["restored"] = None if restored is None else [restored.tier, restored.step]
    if rank == 0:
        report["emergency"] = ckpt.emergency_save(7, {"step": 7, "w": torch.zeros(1 << 16)}, grace_s=120)
    ckpt.close()
    dist.barrier()
    report["after_emergency"] = _steps(local)
    report["durable"] = _steps(durable)
    print("RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
