"""One rank of the Accelerate FSDP2 tests: accelerate prepares FSDP2 (``fully_shard``) on gloo CPU ranks.

Usage: ``python accelerate_fsdp_worker.py <mode> <out>`` under ``tests.helpers.dist.launch_ranks``.

**The forced distributed type.** accelerate 1.16 sets ``DistributedType.FSDP`` only for accelerator devices
(``MULTI_GPU`` and the like); on CPU ranks it stays ``MULTI_CPU`` (DDP), and ``Accelerator(cpu=True)`` never
shards. :func:`fsdp2_accelerator` therefore forces the shared state's distributed type to ``FSDP`` and hands the
state the plugin, before ``Accelerator`` is built: ``accelerator.prepare`` then runs accelerate's own FSDP2 path
(``fsdp2_prepare_model``: ``fully_shard`` over the gloo group; every parameter a ``DTensor`` shard), and
``accelerator.save_state`` / ``load_state`` run accelerate's FSDP2 code (``save_fsdp_model``: DCP) unchanged.

Modes:
    save: 2 ranks. Train 3 steps; ``save_state(acc, uri)`` (asynchronous) and then accelerate's synchronous
        ``accelerator.save_state(<out>/sync-3)`` at the same cut; train 2 steps (the weights change right after
        the cut, behind the fence) recording the losses; the same at step 5. Prints each save's plan.
    resume: 2 ranks, a fresh model (another seed). accelerate's own ``accelerator.load_state`` of the step-5
        generation folder, then ``accelerator.save_state(<out>/reloaded-5)``; then the library's ``load_state(acc,
        uri, step=3)``, two training steps (losses recorded) and ``accelerator.save_state(<out>/resumed-5)``. Then
        the guard (with ``keep_last=3``): step 9 saved; step 10 saved while a write outside the optimizer lands on rank-local shards before
        the staging copy (the staging thread held by an event): refused on every rank, never committed; step 11
        (the retake) commits.
    reshard: 1 or 4 ranks. The library's ``load_state(acc, uri, step=5)`` (written by 2 ranks), then
        ``accelerator.save_state(<out>/reshard-<world size>)``. On 1 rank also through ``memory://``: step 6 saved,
        one step trained, ``load_state`` of the store (a download), ``accelerator.save_state(<out>/memory-6)``.
"""

from __future__ import annotations

import json
import sys
import threading

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed


class Counter:
    """A custom object registered for checkpointing (``custom_checkpoint_0.pkl``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def fsdp2_accelerator() -> Accelerator:
    """An ``Accelerator`` that prepares FSDP2 on gloo CPU ranks (the distributed type forced: module docstring)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # forced: see the module docstring
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    acc.state.fsdp_plugin = plugin  # set only on the accelerator-device branch of AcceleratorState
    assert acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2
    return acc


def make(seed: int):
    set_seed(seed)
    acc = fsdp2_accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def train(acc, model, opt, sched, counter, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))  # from the RNG that checkpoints restore
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        losses.append(loss.item())
    return losses


def _tensors(obj: object) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def main() -> None:
    from lightning_async_ckpt.accelerate import attach, load_state, save_state
    from lightning_async_ckpt.accelerate._fsdp import fsdp_state

    mode, out = sys.argv[1], sys.argv[2]
    uri = f"{out}/store"
    result: dict = {}
    if mode == "save":
        acc, *run = make(0)
        ckpt = attach(acc, uri)
        result["losses"], result["plans"] = [], []
        train(acc, *run, 3)
        shards = [t for sd in fsdp_state(acc).values() for t in _tensors(sd) if t.dim() > 0]
        storages = {t.to_local().untyped_storage().data_ptr(): t.to_local().untyped_storage() for t in shards}
        result["local_bytes"] = sum(st.nbytes() for st in storages.values())  # this rank's shards (FSDP2 pads)
        result["full_bytes"] = sum(t.numel() * t.element_size() for t in shards)  # the whole model and moments
        for step in (3, 5):
            handle = save_state(acc, uri)
            result["plans"].append(handle.plan.summary())
            acc.save_state(f"{out}/sync-{step}")  # accelerate's own synchronous save, same cut (the hook steps aside)
            result["losses"] += train(acc, *run, 2 if step == 3 else 0)
        ckpt.close()
        result["committed_step"] = ckpt.committed_step
    elif mode == "resume":
        acc, *run = make(123)
        ckpt = attach(acc, uri, keep_last=3)  # the resumed run continues the saved run's id: its generations count
        acc.load_state(f"{out}/store/step-00000005")  # accelerate's own loader on the asynchronous generation
        acc.save_state(f"{out}/reloaded-5")
        manifest = load_state(acc, uri, step=3)
        result["loaded_step"] = manifest.step
        result["losses"] = train(acc, *run, 2)
        acc.save_state(f"{out}/resumed-5")
        save_state(acc, uri, step=9)
        train(acc, *run, 1)
        # The guard: hold the staging thread so that a write outside the optimizer lands before step 10's copy.
        gate = threading.Event()
        engine = ckpt._sharded
        engine.stage_worker.submit(lambda: gate.wait(60))
        torn = save_state(acc, uri, step=10)
        with torch.no_grad():
            run[0][0].weight.to_local().add_(1.0)  # this rank's shard, not through the optimizer
        gate.set()
        train(acc, *run, 1)  # the fence: waits for step 10's staging, which finds the write
        assert engine.drain(timeout=60)
        error = torn.committed.exception()
        result["torn"] = [torn.outcome, type(error).__name__, bool(getattr(error, "torn", False)), engine.retake_due]
        save_state(acc, uri, step=11)  # the retake commits
        ckpt.close()
    elif mode == "reshard":
        acc, *run = make(7)
        manifest = load_state(acc, uri, step=5)
        result["loaded_step"] = manifest.step
        acc.save_state(f"{out}/reshard-{dist.get_world_size()}")
        if dist.get_world_size() == 1:  # through an fsspec store that is not a local folder (memory://)
            ckpt = attach(acc, "memory://fsdp2")
            save_state(acc, "memory://fsdp2", step=6)
            train(acc, *run, 1)
            result["from_memory"] = load_state(acc, "memory://fsdp2").step  # waits for step 6, downloads it
            acc.save_state(f"{out}/memory-6")
            ckpt.close()
    result["rank"] = dist.get_rank()
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
