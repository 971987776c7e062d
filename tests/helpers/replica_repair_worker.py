"""One rank of a 2-process gloo run (tests/core/test_replica_repair.py): a damaged replica is repaired, write-once.

Usage: python replica_repair_worker.py BASE. Rank 0 writes the local tier ``BASE/local-0`` and replicates step 1 to
rank 1 (``BASE/local-1``); rank 1 flips one byte of its committed replica (the manifest unchanged), rank 0 replicates
step 1 again (twice), then both ranks restore through :func:`restore_from_peers`. Prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys

import fsspec
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.storage.lookup import newest_intact  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.tiers.replicas import REPLICA_OF_KEY, Replicator, restore_from_peers  # noqa: E402

SIZE = 3 << 20  # several DATA messages


def _store(root: str, version: int) -> CheckpointStore:
    return CheckpointStore(f"{root}/v{version}" if version else root, check_writable=False)


def _folders(root: str) -> dict:
    """Every version folder's committed steps: {version: {step: [replica_of, verified intact]}}."""
    out: dict = {}
    for version in [0, *sorted(int(n[1:]) for n in os.listdir(root) if n[:1] == "v" and n[1:].isdigit())]:
        store = _store(root, version)
        out[str(version)] = {
            str(g.step): [g.manifest.extra.get(REPLICA_OF_KEY), store.verify(g.step).ok] for g in store.generations()
        }
    return out


def _object_path(store: CheckpointStore, step: int) -> str:
    return fsspec.core.url_to_fs(store.object_url(step, "checkpoint.ckpt"))[1]


def main() -> None:
    base = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = f"{base}/local-{rank}"
    os.makedirs(root, exist_ok=True)
    stream, group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    errors: list[str] = []
    replicator = Replicator(
        stream,
        root,
        targets=[1] if rank == 0 else [],
        sources=[] if rank == 0 else [0],
        on_error=lambda exc: errors.append(f"{type(exc).__name__}: {exc}"),
    )
    replicator.start_receiving()
    result: dict = {}
    source = CheckpointStore(root)
    if rank == 0:
        writer = source.begin(1)
        writer.write_bytes("checkpoint.ckpt", bytes([7]) * SIZE)
        writer.commit(cut={"step": 1})
        replicator.replicate(source, 1)
        assert replicator.drain(120)
    dist.barrier(group)  # step 1 is committed in rank 1's folder
    if rank == 1:
        path = _object_path(_store(root, 0), 1)
        with open(path, "r+b") as f:  # bit rot: one byte, the size and the manifest unchanged
            f.seek(SIZE // 2)
            f.write(b"\x00")
        result["damaged"] = _folders(root)
    dist.barrier(group)
    if rank == 0:
        for _ in range(2):  # the second time, the repaired copy is found intact: nothing is sent
            replicator.replicate(source, 1)
            assert replicator.drain(120)
        result["copied"], result["replicated"] = replicator.copied, replicator.replicated
    replicator.close(120)  # rank 1's receiver ends at rank 0's stop message
    dist.barrier(group)
    if rank == 1:
        result["repaired"] = _folders(root)
        with open(_object_path(_store(root, 0), 1), "rb") as f:  # the damaged copy was never rewritten
            result["old_byte"] = f.read()[SIZE // 2]
    found = newest_intact(root, None, accept=lambda m: True, on_skip=lambda url, problems: None)
    agreed = restore_from_peers(
        group,
        root,
        newest_local=None if found is None else (found.version, found.info.step),
        durable_step=None,
        newest_store=lambda version: _store(root, version),
    )
    result["agreed"] = list(agreed) if agreed is not None else None
    if agreed is not None:
        with _store(root, agreed[0]).open(agreed[1], "checkpoint.ckpt") as f:
            result["restored_intact"] = f.read() == bytes([7]) * SIZE
    result["after_restore"] = _folders(root)
    result["errors"] = errors
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
