"""One process of a two-process Accelerate run with two tiers and ``replicas=1``, launched by
tests/accelerate/test_accelerate_replicas.py.

Usage: python accelerate_replicas_worker.py BASE
    Every phase below runs in this one pair of processes, one after the other (a barrier between phases). Each
    process has its own "node-local" folder ``BASE/run/local-<rank>`` (``ranks_per_node=1``: one node each); the
    durable tier is ``faulty://BASE/run/durable`` (a wrapper around the local disk whose ``open``/``cat_file`` calls
    are recorded, so a resume can say how many reads of ``uri`` it made). Before a phase, process 0 damages the
    folders as the phase needs; after it, process 0 copies ``BASE/run`` to ``BASE/after-<phase>`` so the test can
    inspect the folders as that phase left them.

    ``train``: steps 1..8, ``save_state`` after steps 1..7 (a local cut every 2 steps, promoted every 4: local 2, 4,
        6, durable 4); reports the weights after step 8 and the steps replicated.
    ``resumed`` (process 0's folder deleted), ``damaged`` (process 0's folder deleted again and a byte of process 1's
        replica of step 6 changed, same size) and ``fallen_back`` (both folders deleted): ``attach`` as in
        ``train``, ``load_state(..., local_dirpath=...)``, train on to step 8 with the same saves; report the step
        loaded, whether it is a promoted generation, the reads of ``uri`` that ``load_state`` made, the weights after
        step 8, the steps replicated and the local location written.
    ``layout`` (in ``BASE/layout``): ``attach(..., replicas=1)`` without ``ranks_per_node`` (accelerate's layout: both
        processes on one node here), then ``replicas=2``; reports the layout, the targets and the ``ConfigError``.

Prints ``RESULT <phase> {json}`` after each phase, and ``PHASE <phase>`` on stderr before it (so the test can tell
which phase logged what).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.errors import ConfigError  # noqa: E402
from lightning_async_ckpt.testing import (  # noqa: E402
    Fault,
    FaultCall,
    register_faulty,
)
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402

register_faulty()  # this process names faulty:// URLs

STEPS = 8
PHASES = ("train", "resumed", "damaged", "fallen_back")


def _damage(run_dir: str, phase: str) -> None:
    """What happened to the nodes' local tiers before ``phase`` (process 0 does it, both then pass a barrier)."""
    if phase in ("resumed", "damaged", "fallen_back"):
        shutil.rmtree(f"{run_dir}/local-0")  # the writer's node lost its local tier
    if phase == "damaged":
        with open(f"{run_dir}/local-1/step-00000006/model.safetensors", "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\0\0\0\1")  # same size, other bytes: only re-reading against the checksum tells
    if phase == "fallen_back":
        shutil.rmtree(f"{run_dir}/local-1")  # both nodes lost their local tiers


def _phase(run_dir: str, phase: str) -> dict:
    reads: list[FaultCall] = []
    record = [Fault(op=op, times=None, callback=reads.append) for op in ("open", "cat_file")]
    options = {"target_protocol": "file", "faults": record}
    run = make_run()
    rank = run.acc.process_index
    ckpt = attach(
        run.acc,
        f"faulty://{run_dir}/durable",
        storage_options=options,
        local_dirpath=f"{run_dir}/local-{rank}",
        local_every_n_train_steps=2,
        every_n_train_steps=4,
        replicas=1,
        ranks_per_node=1,
    )
    report: dict = {"rank": rank}
    first = 1
    if phase != "train":
        before = len(reads)
        manifest = load_state(
            run.acc, f"faulty://{run_dir}/durable", storage_options=options, local_dirpath=ckpt.local_dirpath
        )
        assert manifest is not None
        report.update(
            step=manifest.step,
            promoted=PROMOTED_FROM_KEY in manifest.extra,
            durable_reads=len(reads) - before,
            read_paths=sorted({c.path for c in reads[before:]})[:5],
        )
        first = manifest.step + 1
    for step in range(first, STEPS + 1):
        train(run, 1)
        if step < STEPS:
            save_state(run.acc)
    ckpt.drain()
    report["replicated"] = sorted(ckpt.replicas.replicator.replicated) if rank == 0 else []
    report["local_uri"] = ckpt.local_uri
    ckpt.close()
    report["weights"] = {k: v.tolist() for k, v in run.acc.unwrap_model(run.model).state_dict().items()}
    return report


def _layout(base: str) -> dict:
    run = make_run()
    local = f"{base}/local-{run.acc.process_index}"
    ckpt = attach(run.acc, f"{base}/durable", local_dirpath=local, replicas=1)
    report = {"rank": run.acc.process_index, "ranks_per_node": ckpt.replicas.ranks_per_node}
    report["targets"] = ckpt.replicas.replicator.targets
    report["sources"] = ckpt.replicas.replicator.sources
    ckpt.close()
    try:
        attach(run.acc, f"{base}/durable", local_dirpath=local, replicas=2)
    except ConfigError as exc:
        report["error"] = str(exc)
    return report


def main() -> None:
    base = sys.argv[1]
    run_dir = f"{base}/run"
    for phase in PHASES:
        if phase != "train":
            if dist.get_rank() == 0:
                _damage(run_dir, phase)
            dist.barrier()
        print(f"PHASE {phase}", file=sys.stderr, flush=True)
        report = _phase(run_dir, phase)
        dist.barrier()  # both processes closed their checkpointers: the folders are as this phase left them
        if dist.get_rank() == 0:
            shutil.copytree(run_dir, f"{base}/after-{phase}")
        print(f"RESULT {phase} " + json.dumps(report), flush=True)
    print("PHASE layout", file=sys.stderr, flush=True)
    print("RESULT layout " + json.dumps(_layout(f"{base}/layout")), flush=True)


if __name__ == "__main__":
    main()
