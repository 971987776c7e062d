"""One rank of a two-process gloo run of a generation restored from a peer and committed in the background,
launched by tests/core/test_restored_commit.py.

Usage: python restored_commit_worker.py BASE MODE. Rank 1's folder ``BASE/local-1`` holds committed step 3 (written
by rank 1 in mode ``gated``); rank 0's ``BASE/local-0`` is empty. Both ranks call ``restore_from_peers(...,
background=True)``; rank 0 receives step 3 while its durable copy is held back (``DeferredSync.sync`` waits for an
event) and reports what a fresh listing and ``manifest_of`` say, and the bytes it reads, before and after releasing
the commit.

Modes: ``gated`` (the commit is released, then joined); ``crash`` (rank 0 ends with ``os._exit`` while its commit is
held: the process dies before the manifest); ``again`` (a plain restore after the crash). Prints one line
``RESULT {json}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.storage.lookup import newest_intact  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.tiers import replica_persist  # noqa: E402
from lightning_async_ckpt.tiers.replicas import REPLICA_OF_KEY, restore_from_peers  # noqa: E402

STEP = 3


def _state() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(3 << 20, generator=gen), "step": STEP}  # 12 MiB: many DATA messages


def _newest(root: str) -> tuple[int, int] | None:
    found = newest_intact(root, None, accept=lambda m: True, on_skip=lambda url, problems: None)
    return None if found is None else (found.version, found.info.step)


def _digest(store: CheckpointStore, manifest) -> str:
    with store.fs.open(f"{store.generation_path(STEP)}/{manifest.object('checkpoint.ckpt').key}", "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main(base: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = f"{base}/local-{rank}"
    os.makedirs(root, exist_ok=True)
    if rank == 1 and mode == "gated":
        writer = CheckpointStore(root).begin(STEP)
        with writer.open("checkpoint.ckpt") as stream:
            torch.save(_state(), stream)
        writer.commit(cut={"step": STEP})
    release = threading.Event()
    held = threading.Event()
    if mode in ("gated", "crash"):
        sync = replica_persist.DeferredSync.sync

        def held_sync(self) -> None:
            held.set()
            release.wait()
            sync(self)

        replica_persist.DeferredSync.sync = held_sync  # the durable copy waits for the test's event
    dist.barrier()
    agreed = restore_from_peers(
        dist.group.WORLD,
        root,
        newest_local=_newest(root),
        durable_step=None,
        newest_store=lambda version: CheckpointStore(root, check_writable=False),
        background=True,
    )
    result: dict = {"rank": rank, "agreed": list(agreed) if agreed else None}
    store = CheckpointStore(root, check_writable=False)
    if rank == 0:
        if mode != "again":
            result["held"] = held.wait(60)  # the background commit reached its fsync and waits there
        preview = replica_persist.manifest_of(store, STEP)
        result["listed_before"] = [g.step for g in store.generations()]  # a fresh listing: committed only
        result["newest_before"] = _newest(root)
        result["digest_before"] = _digest(store, preview)
        result["loaded_before"] = torch.equal(
            torch.load(
                store.fs.open(f"{store.generation_path(STEP)}/{preview.object('checkpoint.ckpt').key}", "rb"),
                weights_only=True,
            )["w"],
            _state()["w"],
        )
        if mode == "crash":
            print("RESULT " + json.dumps(result), flush=True)
            os._exit(0)  # the process dies while the restored copy is not yet durable: no manifest
        release.set()
        result["joined"] = replica_persist.wait_restored(120)
        committed = CheckpointStore(root, check_writable=False)
        result["listed_after"] = [g.step for g in committed.generations()]
        result["verified_after"] = committed.verify(STEP).ok
        final = committed.manifest(STEP)
        result["replica_of"] = final.extra.get(REPLICA_OF_KEY)
        result["same_objects"] = [o.__dict__ for o in final.objects] == [o.__dict__ for o in preview.objects]
        result["digest_after"] = _digest(committed, final)
    else:
        result["digest_source"] = _digest(store, store.manifest(STEP))
    dist.barrier() if mode != "crash" else None
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group() if mode != "crash" else None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
