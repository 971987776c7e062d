"""One process of a two-process Accelerate run with two tiers and ``replicas=1``, launched by
tests/accelerate/test_accelerate_replicas.py.

Usage: python accelerate_replicas_worker.py BASE PHASE
    Each process has its own "node-local" folder ``BASE/local-<rank>`` (``ranks_per_node=1``: one node each); the
    durable tier is ``faulty://BASE/durable`` (a wrapper around the local disk whose ``open``/``cat_file`` calls
    are recorded, so the resume can say how many reads of ``uri`` it made).
    PHASE ``train``: steps 1..8, ``save_state`` after steps 1..7 (a local cut every 2 steps, promoted every 4: local
    2, 4, 6, durable 4); prints the weights after step 8 and the steps replicated.
    PHASE ``resume``: ``attach`` as in ``train``, ``load_state(..., local_dirpath=...)``, train on to step 8 with
    the same saves; prints the step loaded, whether it is a promoted generation, the reads of ``uri`` that
    ``load_state`` made, the weights after step 8, the steps replicated and the local location written.
    PHASE ``layout``: ``attach(..., replicas=1)`` without ``ranks_per_node`` (accelerate's layout: both processes on
    one node here), then ``replicas=2``; prints the layout, the targets and the ``ConfigError``.
Prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt.accelerate import attach, load_state, save_state  # noqa: E402
from lightning_async_ckpt.errors import ConfigError  # noqa: E402
from lightning_async_ckpt.storage.promote import PROMOTED_FROM_KEY  # noqa: E402
from lightning_async_ckpt.testing import Fault, FaultCall  # noqa: E402
from tests.helpers.accelerate_runs import make_run, train  # noqa: E402

STEPS = 8


def main() -> None:
    base, phase = sys.argv[1], sys.argv[2]
    reads: list[FaultCall] = []
    record = [Fault(op=op, times=None, callback=reads.append) for op in ("open", "cat_file")]
    options = {"target_protocol": "file", "faults": record}
    run = make_run()
    rank = run.acc.process_index
    if phase == "layout":
        _layout(run, base)
        return
    ckpt = attach(
        run.acc,
        f"faulty://{base}/durable",
        storage_options=options,
        local_dirpath=f"{base}/local-{rank}",
        local_every_n_steps=2,
        promote_every_n_steps=4,
        replicas=1,
        ranks_per_node=1,
    )
    report: dict = {"rank": rank}
    first = 1
    if phase == "resume":
        before = len(reads)
        manifest = load_state(
            run.acc, f"faulty://{base}/durable", storage_options=options, local_dirpath=ckpt.local_dirpath
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
    print("RESULT " + json.dumps(report), flush=True)


def _layout(run, base: str) -> None:
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
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
