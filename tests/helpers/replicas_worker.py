"""One rank of a 3-process gloo run of the plain replica machinery (tiers/replicas.py), launched by
tests/core/test_replicas.py.

Usage: python replicas_worker.py BASE. Rank 0 writes the local tier ``BASE/local-0``; rank 1 has ``BASE/local-1`` and
rank 2 shares it (two ranks of one node). Prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.storage.lookup import newest_intact  # noqa: E402
from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import (
    Fault,  # noqa: E402
    register_faulty,
)
from lightning_async_ckpt.tiers.replicas import (  # noqa: E402
    REPLICA_OF_KEY,
    Replicator,
    replica_targets,
    restore_from_peers,
)

register_faulty()  # this process names faulty:// URLs


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", bytes([step]) * (3 << 20))  # 3 MiB: several DATA messages per object
    writer.write_bytes("extra/meta.bin", b"meta %d" % step)
    writer.commit(cut={"step": step})


def _state(root: str) -> dict:
    store = CheckpointStore(root, check_writable=False)
    return {
        str(g.step): (g.manifest.extra.get(REPLICA_OF_KEY) if g.committed else "uncommitted")
        for g in store.generations(include_uncommitted=True)
    }


def _newest(root: str) -> tuple[int, int] | None:
    found = newest_intact(root, None, accept=lambda m: True, on_skip=lambda url, problems: None)
    return None if found is None else (found.version, found.info.step)


def _restore(root: str, durable_step: int | None) -> list | None:
    agreed = restore_from_peers(
        group,
        root,
        newest_local=_newest(root),
        durable_step=durable_step,
        newest_store=lambda version: CheckpointStore(f"{root}/v{version}" if version else root),
    )
    return None if agreed is None else list(agreed)


def _bounded_round(root: str, targets: list[int]) -> dict:
    """Rank 0's copy of step 10 is held (gated on an event) while steps 11 and 12 commit: ``replicate`` returns at
    once each time, 12 replaces the pending 11, and every read of a source object happens on the replicate thread."""
    rank = dist.get_rank()
    if rank != 0:
        receiver = Replicator(group, root, targets=[], sources=[0])
        receiver.start_receiving()
        receiver.close(120)  # joins the receiver: it ends at rank 0's stop message
        return {"bounded": _state(root)}
    opened, release, readers = threading.Event(), threading.Event(), []
    faults = [
        Fault(op="open", path="checkpoint.ckpt", times=None, callback=lambda c: readers.append(_thread_name())),
        Fault(op="open", path="step-00000010/checkpoint.ckpt", callback=lambda c: opened.set(), stall=release),
    ]
    plain = CheckpointStore(root)
    source = CheckpointStore(f"faulty://{root}", {"target_protocol": "file", "faults": faults})
    sender = Replicator(group, root, targets=targets, sources=[])
    _commit(plain, 10)
    sender.replicate(source, 10)
    assert opened.wait(60)  # the copy of step 10 is in flight, held before its first byte
    for step in (11, 12):
        _commit(plain, step)
        sender.replicate(source, step)  # returns at once: the training thread never waits for a replica
    release.set()
    assert sender.drain(120)
    sender.close(120)
    return {"bounded_replicated": sender.replicated, "bounded_readers": sorted(set(readers))}


def _thread_name() -> str:
    return threading.current_thread().name


def main() -> None:
    global group
    base = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    root = f"{base}/local-{0 if rank == 0 else 1}"
    targets = replica_targets(0, world, replicas=2, ranks_per_node=1)  # [1, 2]
    errors: list[str] = []
    failed = threading.Event()

    def on_error(exc: BaseException) -> None:
        errors.append(f"{type(exc).__name__}: {exc}")
        failed.set()

    replicator = Replicator(
        group, root, targets=targets if rank == 0 else [], sources=[] if rank == 0 else [0], on_error=on_error
    )
    replicator.start_receiving()
    if rank == 0:
        store = CheckpointStore(root)
        _commit(store, 1)
        replicator.replicate(store, 1)
        assert replicator.drain(120)
        _commit(store, 2)
        obj = store.object_url(2, "checkpoint.ckpt")
        with open(obj, "r+b") as f:  # the source object no longer matches its manifest: never replicated
            f.seek(100)
            f.write(b"\xff")
        replicator.replicate(store, 2)
        assert replicator.drain(120) and failed.is_set()
    if rank == 0:
        replicator.close(120)  # the stop message, acknowledged by every target: their receivers are ending
    dist.barrier(group=group)
    # A second round over the same group (a second fit): a new sender; the receivers restart.
    first = {"replicated": replicator.replicated, "copied": replicator.copied}
    if rank == 0:
        replicator = Replicator(group, root, targets=targets, sources=[], on_error=on_error)
        _commit(store, 3)
        replicator.replicate(store, 3)
        assert replicator.drain(120)
    else:
        replicator.start_receiving()
    replicator.close(120)  # rank 0: the stop message; the others: join their receiver, which ends at it
    dist.barrier(group=group)
    result = {"rank": rank, "after_replicas": _state(root), "errors": errors, **first}
    if rank == 0:
        shutil.rmtree(root)  # rank 0's node lost its local tier
    dist.barrier(group=group)
    result["agreed_lost_0"] = _restore(root, durable_step=None)
    result["after_restore_0"] = _state(root)
    dist.barrier(group=group)
    if rank == 1:
        shutil.rmtree(root)  # the node of ranks 1 and 2 lost its (shared) folder
    dist.barrier(group=group)
    result["agreed_lost_1"] = _restore(root, durable_step=None)
    result["after_restore_1"] = _state(root)
    result["agreed_durable_newer"] = _restore(root, durable_step=5)
    dist.barrier(group=group)
    if rank == 1:  # the shared folder's copy of step 3 is damaged (its manifest intact): never overwritten
        path = CheckpointStore(root).object_url(3, "checkpoint.ckpt")
        with open(path, "r+b") as f:
            f.seek(10)
            f.write(b"\xee")
    dist.barrier(group=group)
    result["agreed_damaged"] = _restore(root, durable_step=None)
    result["damaged_v1"] = _state(f"{root}/v1")
    dist.barrier(group=group)
    result.update(_bounded_round(root, targets))
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


group = None

if __name__ == "__main__":
    main()
