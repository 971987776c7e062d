"""One rank of the throttling test: raw FSDP2 on CPU (gloo); rank 1's object store answers its first writes "slow down".

Usage: ``python throttled_worker.py <out>`` under ``tests.helpers.dist.launch_ranks``; prints one ``RESULT {json}``
with the committed step and, on rank 0, the manifest's per-rank write retries.
"""

from __future__ import annotations

import errno
import json
import sys

import torch
import torch.distributed as dist
from sharded_worker import make_model  # the script's folder is on sys.path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.testing import Fault, register_faulty

register_faulty()  # this process names faulty:// URLs

GROUP_TIMEOUT_S = 30.0
#: What s3fs raises for S3's throttling answer (a ``ClientError`` translated to ``OSError``).
SLOW_DOWN = OSError(
    errno.EBUSY, "An error occurred (SlowDown) when calling the UploadPart operation: Please reduce your request rate."
)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    faults = [Fault(op="write", path="__1_0.distcp", times=2, error=SLOW_DOWN)] if rank == 1 else []
    with ShardedCheckpointer(
        f"faulty://{out}/store",
        storage_options={"target_protocol": "file", "faults": faults},
        timeout_s=GROUP_TIMEOUT_S,
    ) as ckpt:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        manifest = ckpt.save(1, {"model": msd, "optim": osd}).result(timeout=2 * GROUP_TIMEOUT_S)
    result: dict = {"rank": rank, "committed": manifest.step}
    if rank == 0:
        store = CheckpointStore(f"{out}/store", check_writable=False)
        result["write_retries"] = store.manifest(1).extra.get("write_retries")
        result["verified"] = store.verify(1).ok
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
