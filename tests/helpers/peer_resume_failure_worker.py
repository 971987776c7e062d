"""One rank of the peer-resume failure test: a rank that cannot look at its local tier must not leave the others
waiting in a collective. Usage: ``python peer_resume_failure_worker.py <out> <where>`` under
``tests.helpers.dist.launch_ranks``; ``<where>``: ``runs`` (listing the local tier's runs fails on rank 1) or
``state`` (listing its committed steps fails on rank 1). Prints ``RESULT {json}`` with the error each rank raised."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.errors import StoreUnavailableError  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.tiers import peer_replicas, sharded_resume  # noqa: E402


def _unlistable(*args: Any, **kwargs: Any) -> Any:
    raise StoreUnavailableError("the local tier cannot be listed on rank 1")


def main(out: str, where: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == 1 and where == "runs":
        sharded_resume.tier_runs = _unlistable  # the real function, made to fail as a flaky disk would
    if rank == 1 and where == "state":
        peer_replicas.local_state = _unlistable
    local = f"{out}/node{rank}"
    os.makedirs(local, exist_ok=True)
    result: dict[str, Any] = {"rank": rank}
    try:
        peer_replicas.local_from_peers(dist.group.WORLD, local, CheckpointStore(f"{out}/durable"))
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        result["error"] = type(exc).__name__
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
