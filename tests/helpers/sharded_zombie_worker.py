"""One rank of the stalled-rank test: attempt A's rank-1 data write stalls past the failure, attempt B commits.

Usage: ``python sharded_zombie_worker.py <out>`` under ``tests.helpers.dist.launch_ranks``; prints one
``RESULT {json}``.

Attempt A saves step 2 through a ``faulty://`` view of ``<out>/store`` whose first write to rank 1's data file
blocks on a ``threading.Event``: rank 0 fails the save after A's group timeout (rank 1 never reports), the job
"restarts" as attempt B (new checkpointers, same folder, same step) and commits step 2 while A's write is still
held. Only then is A's write released; it runs to its end. Every rank reports whether step 2 verifies and
whether ``dcp.load`` of it returns B's tensors.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_async_ckpt.testing import register_faulty

register_faulty()  # this process names faulty:// URLs

A_TIMEOUT_S = 5.0
GROUP_TIMEOUT_S = 60.0


def _map(state: Any, fn: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {k: _map(v, fn) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_map(v, fn) for v in state)
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(_local(a), _local(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def main(out: str) -> None:
    from lightning_async_ckpt.sharded import ShardedCheckpointer
    from lightning_async_ckpt.storage.claims import claim_liveness, read_claim
    from lightning_async_ckpt.storage.store import CheckpointStore
    from lightning_async_ckpt.testing import Fault
    from tests.helpers.sharded_worker import _state, _train_step, make_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model, opt, rank, 0)
    result: dict[str, Any] = {"rank": rank}

    held = threading.Event()
    faults = [Fault(op="write", path="step-00000002/__1_0.distcp", stall=held, stall_timeout_s=300)]
    attempt_a = ShardedCheckpointer(
        f"faulty://{out}/store",
        storage_options={"target_protocol": "file", "faults": faults if rank == 1 else []},
        timeout_s=A_TIMEOUT_S,
        run_id="run",
    )
    save_a = attempt_a.save(2, _state(model, opt))
    if rank == 0:
        result["a"] = type(save_a.committed.exception(timeout=GROUP_TIMEOUT_S)).__name__
    dist.barrier()  # A failed on the coordinator; rank 1's write of A is still held

    _train_step(model, opt, rank, 1)
    state = _state(model, opt)
    expected = _map(state, lambda t: t.detach().clone())
    attempt_b = ShardedCheckpointer(f"{out}/store", timeout_s=GROUP_TIMEOUT_S, run_id="run")
    result["b"] = attempt_b.save(2, state).result(timeout=GROUP_TIMEOUT_S).step
    store = CheckpointStore(f"{out}/store", check_writable=False)
    if rank == 1:
        # The held rank still holds its own leased claim on the step (B's commit did not remove it).
        folder = f"{out}/store/step-00000002"
        mine = [n for n in os.listdir(folder) if n.startswith(".writer-") and n.endswith("-r1.json")]
        result["a_rank1_claim_live"] = [claim_liveness(read_claim(store.fs, f"{folder}/{n}")).value for n in mine]
        held.set()  # A's stalled write wakes up after B committed
        result["a"] = type(save_a.committed.exception(timeout=GROUP_TIMEOUT_S)).__name__
    dist.barrier()  # A's write ran to its end

    info = store.latest()
    result["latest"] = info.step if info else None
    result["verify_ok"] = store.verify(2).ok
    target = _map(expected, torch.zeros_like)
    dcp.load(target, checkpoint_id=info.dcp_path if info else store.generation_path(2))
    result["loads_b"] = _same(target, expected)
    for ckpt in (attempt_a, attempt_b):
        try:
            ckpt.close(timeout=GROUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - A's failure is raised once more at close
            result.setdefault("closed_with", []).append(type(exc).__name__)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1])
