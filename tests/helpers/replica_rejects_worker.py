"""One rank of a 2-process gloo run: replica messages the receiver must reject, launched by
tests/core/test_replica_rejects.py.

Usage: python replica_rejects_worker.py BASE. Rank 1 receives into ``BASE/tier`` through a real
:class:`~lightning_async_ckpt.tiers.replicas.Replicator`; rank 0 speaks the wire itself (as a faulty or hostile peer
would): a generation aimed at ``../escape``, one at an absolute folder, one whose manifest names an object
``../../../pwned``, then a good one, then it closes a replicator of its own and calls ``replicate()`` after that.
Each rank prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.storage.store import CheckpointStore  # noqa: E402
from lightning_async_ckpt.tiers.replica_wire import Kind, Wire, send_generation  # noqa: E402
from lightning_async_ckpt.tiers.replicas import Replicator  # noqa: E402


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", bytes([step]) * 1024)
    writer.commit(cut={"step": step})


def _send(wire: Wire, store: CheckpointStore, step: int, where: str) -> str:
    try:
        return "copied" if send_generation(wire, store, step, where, 1) else "held"
    except Exception as exc:  # noqa: BLE001 - the answer is the result
        return f"{type(exc).__name__}: {exc}"


def _sender(base: str, stream: object) -> dict:
    source = CheckpointStore(f"{base}/source")
    for step in (1, 2):
        _commit(source, step)
    wire = Wire(stream, tag=1)  # rank 0's conversation with rank 1's receiver (the tag a Replicator of rank 0 uses)
    report = {
        "dotdot": _send(wire, source, 1, "../escape"),
        "absolute": _send(wire, source, 1, f"{base}/absolute"),
    }
    # A manifest naming an object outside the generation: a peer's message, never trusted.
    header = {"step": 1, "where": "", "manifest": source.manifest(1).to_json().decode()}
    header["manifest"] = header["manifest"].replace('"checkpoint.ckpt"', '"../../../pwned"')
    wire.send(1, Kind.GEN, json.dumps(header).encode())
    kind, payload = wire.recv(1)
    report["pwned"] = [int(kind), payload.decode(errors="replace")]
    report["good"] = _send(wire, source, 2, "")  # the receiver lives on
    # Rank 0's own replicator: closing it stops rank 1's receiver; replicate() after close says so.
    replicator = Replicator(stream, f"{base}/source", targets=[1], sources=[])
    replicator.close()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    handler = Keep()
    logging.getLogger("lightning_async_ckpt").addHandler(handler)
    replicator.replicate(source, 2)
    logging.getLogger("lightning_async_ckpt").removeHandler(handler)
    report["after_close"] = records
    return report


def _receiver(base: str, stream: object) -> dict:
    replicator = Replicator(stream, f"{base}/tier", targets=[], sources=[0])
    replicator.start_receiving()
    replicator.close()  # returns once rank 0's STOP was taken (a receiver that died early returns at once)
    return {"received": replicator.received}


def main() -> None:
    base = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stream = dist.new_group(backend="gloo")  # the replica messages, apart from the barrier below
    report = _sender(base, stream) if rank == 0 else _receiver(base, stream)
    dist.barrier()
    print("RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
