"""One rank of a two-process plain loop with two tiers and ``replicas=1``, launched by tests/core/test_tiered_replicas.py.

Usage: python plain_replicas_worker.py BASE
    Every phase below runs in this one pair of processes, one after the other (a barrier between phases). Each rank
    has its own "node-local" folder ``BASE/run/local-<rank>``; the durable tier is ``faulty://BASE/run/durable`` (a
    wrapper counting every call). A DDP model on gloo; rank 0 saves (single writer). Before a phase, rank 0 damages
    the folders as the phase needs; after it, rank 0 copies ``BASE/run`` to ``BASE/after-<phase>`` so the test can
    inspect the folders as that phase left them.

    ``train``: steps 1..8, saves at 2, 4, 6 (promoted every 4); reports the weights after step 8.
    ``resumed`` (rank 1's folder deleted) and ``fallen_back`` (both folders deleted): ``restore()`` on both ranks,
        load, train steps on to 8; report the weights, the tier and step restored and how many durable reads
        (open/cat_file) ``restore()`` made.
Prints ``RESULT <phase> {json}`` after each phase.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_async_ckpt import CheckpointStore  # noqa: E402
from lightning_async_ckpt.errors import ConfigError  # noqa: E402
from lightning_async_ckpt.testing import register_faulty  # noqa: E402
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer  # noqa: E402

register_faulty()  # this process names faulty:// URLs

PHASES = ("train", "resumed", "fallen_back")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _reads(fs: object) -> int:
    return sum(fs.count(op) for op in ("open", "cat_file"))  # type: ignore[attr-defined]


def _damage(run_dir: str, phase: str) -> None:
    if phase in ("resumed", "fallen_back"):
        shutil.rmtree(f"{run_dir}/local-1")  # rank 1's node lost its local tier between the runs
    if phase == "fallen_back":
        shutil.rmtree(f"{run_dir}/local-0")  # both local tiers lost (new nodes)


def _phase(run_dir: str, phase: str) -> dict:
    rank = dist.get_rank()
    durable = CheckpointStore(f"faulty://{run_dir}/durable", {"target_protocol": "file"})
    ckpt = TieredCheckpointer(f"{run_dir}/local-{rank}", durable, every_n_train_steps=4, replicas=1)
    model, opt = _model()
    report: dict = {"rank": rank}
    first = 1
    if phase != "train":
        before = _reads(durable.fs)
        restored = ckpt.restore()
        report["durable_reads"] = _reads(durable.fs) - before
        assert restored is not None
        report.update(tier=restored.tier, step=restored.step, where=restored.store.uri)
        with restored.open() as f:
            state = torch.load(f, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        first = restored.step + 1
    for step in range(first, 9):
        _step(model, opt, step)
        if phase == "train" and rank == 0 and step in (2, 4, 6):
            state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}
            ckpt.save(step, state, modules=[model], optimizers=[opt])
        if phase == "train" and rank == 1 and step == 2:
            try:  # a rank that only receives replicas must not save (the single-writer layout)
                ckpt.save(step, {"step": step})
            except ConfigError as exc:
                report["refused"] = str(exc)
    ckpt.close()
    report["weights"] = {k: v.tolist() for k, v in model.module.state_dict().items()}
    return report


def main() -> None:
    base = sys.argv[1]
    run_dir = f"{base}/run"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for phase in PHASES:
        if rank == 0:
            _damage(run_dir, phase)
        dist.barrier()
        report = _phase(run_dir, phase)
        dist.barrier()  # both ranks closed their checkpointers: the folders are as this phase left them
        if rank == 0:
            shutil.copytree(run_dir, f"{base}/after-{phase}")
        print(f"RESULT {phase} " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
