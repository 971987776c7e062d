"""One rank of the sharded two-tier tests: raw FSDP2 ``fully_shard`` on CPU (gloo) with ``TieredShardedCheckpointer``.

Usage: ``python sharded_tiers_worker.py <out> <mode>[,<mode>...]`` under ``tests.helpers.dist.launch_ranks``. Modes
run one after the other in this pair of processes, each in ``<out>/<mode>``, and print ``RESULT <mode> {json}``
(a mode that raises prints its traceback under ``exception`` and the process exits 1). A mode name ends in the
local layout: ``:node`` (each rank its own node-local folder ``node<r>``, as on two nodes) or ``:shared`` (both
ranks one folder).

Modes:
    equiv: train 6 steps, save every step, promote every 2nd; load step 4 from the local tier (every rank its own
        folder) and from the durable tier into fresh states; both and the weights at step 4 must be equal.
    deleted / damaged / behind: a base run (steps 1-5 saved, 2 and 4 promoted, local keeps 1, trained on to 6; run
        once per layout, in the first such mode's ``base`` folder) is copied; then rank 1's local folder is deleted / a byte of its step-5 data file is flipped / its step-5
        generation is removed; a new checkpointer resumes (both ranks must agree on durable step 4), trains 5-6 and
        must end with the base run's weights at step 6; it saves 5-6 and promotes 6.
    emergency: rank 1 alone receives a real SIGUSR1 after step 3; ``preemption_due`` agrees on every rank, the
        emergency save commits step 3 locally on every rank and promotes it.
    kill: rank 1 SIGKILLs itself while uploading its step-2 file to the durable tier (rank 0 may have uploaded
        its own); rank 0 must get the promotion error and the durable tier lists no step 2. Last mode.
    kill_resume: (a new launch, on ``kill``'s folders) resumes local step 2 on both ranks, saves 3-4, promotes 4;
        the durable tier lists only committed steps.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.testing import Fault, register_faulty
from lightning_async_ckpt.tiers.sharded_resume import TierChoice
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer

register_faulty()  # this process names faulty:// URLs

GROUP_TIMEOUT_S = 60.0


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    model(torch.randn(4, 8, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    # A replicated plain tensor: DCP writes it once; the local tier writes it on every rank.
    return {"model": msd, "optim": osd, "extra": torch.arange(4.0) + step}


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: _local(v).detach().clone() for k, v in model.state_dict().items()}


def _flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(_flat(v, f"{prefix}{i}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = _local(state).detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys that differ (or exist on one side only)."""
    keys = set(a) | set(b)
    return sorted(k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _folder(out: str, layout: str) -> str:
    return f"{out}/node{dist.get_rank()}" if layout == "node" else f"{out}/shared"


def _ckpt(local: str, durable: CheckpointStore | str, **kwargs: Any) -> TieredShardedCheckpointer:
    return TieredShardedCheckpointer(local, durable, timeout_s=GROUP_TIMEOUT_S, **kwargs)


def _equiv(out: str, layout: str, result: dict) -> None:
    rank = dist.get_rank()
    model, opt = _model()
    ckpt = _ckpt(_folder(out, layout), f"{out}/durable", every_n_train_steps=2)
    result["resumed"] = ckpt.resume(_state(model, opt, 0)) is not None
    weights = {}
    for step in range(1, 7):
        _train(model, opt, step)
        weights[step] = _weights(model)
        ckpt.save(step, _state(model, opt, step))
    ckpt.drain()
    result["promoted_step"] = ckpt.promoted_step
    local_store = ckpt.store
    ckpt.close()
    durable = CheckpointStore(f"{out}/durable", check_writable=False)
    result["durable_steps"] = [g.step for g in durable.generations()]
    result["local_names"] = sorted(o.name for o in local_store.manifest(4).objects)
    result["durable_ranks"] = durable.manifest(4).ranks and sorted(durable.manifest(4).extra["ranks"])
    loaded = {}
    for tier, store in (("local", local_store), ("durable", durable)):
        fresh, fresh_opt = _model()
        state = _state(fresh, fresh_opt, 0)
        TierChoice(4, tier, store).load(state)
        loaded[tier] = _flat(state)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        result[f"{tier}_vs_step4_weights"] = _same(_weights(fresh), weights[4])
    result["local_vs_durable"] = _same(loaded["local"], loaded["durable"])
    result["tensors_compared"] = len(loaded["local"])
    result["extra_local"] = loaded["local"]["extra"].tolist()
    result["rank"] = rank


_bases: dict[str, tuple[str, dict[int, dict[str, torch.Tensor]]]] = {}


def _base(out: str, layout: str) -> dict[int, dict[str, torch.Tensor]]:
    """The base run's folders in ``out`` and its weights per step: run once per layout (in the first fallback mode's
    ``base`` folder), copied for every later mode of that layout (rank 0 copies the durable tier)."""
    if layout not in _bases:
        where = f"{out}/base"
        os.makedirs(where, exist_ok=True)
        model, opt = _model()
        ckpt = _ckpt(_folder(where, layout), f"{where}/durable", every_n_train_steps=2, local_keep_last=1)
        weights = {}
        for step in range(1, 7):
            _train(model, opt, step)
            weights[step] = _weights(model)
            if step <= 5:
                ckpt.save(step, _state(model, opt, step))
        ckpt.close()
        dist.barrier()  # every rank's part committed: the base folders are complete
        _bases[layout] = (where, weights)
    where, weights = _bases[layout]
    if layout == "node" or dist.get_rank() == 0:
        shutil.copytree(_folder(where, layout), _folder(out, layout))
    if dist.get_rank() == 0:
        shutil.copytree(f"{where}/durable", f"{out}/durable")
    dist.barrier()  # the copies are complete before any rank damages its part
    return weights


def _fallback(out: str, layout: str, result: dict, damage: str) -> None:
    rank = dist.get_rank()
    weights = _base(out, layout)
    store1 = f"{_folder(out, layout)}/rank-1"
    if rank == 1:
        if damage == "deleted":
            shutil.rmtree(store1)
        else:
            gen = f"{store1}/step-00000005"
            if damage == "damaged":
                data = next(f for f in os.listdir(gen) if f.startswith("__1_0.distcp"))
                with open(f"{gen}/{data}", "r+b") as f:
                    f.seek(7)
                    byte = f.read(1)
                    f.seek(7)
                    f.write(bytes([byte[0] ^ 0xFF]))
            else:
                shutil.rmtree(gen)
    dist.barrier()
    model, opt = _model()
    ckpt = _ckpt(_folder(out, layout), f"{out}/durable", every_n_train_steps=2, local_keep_last=1)
    state = _state(model, opt, 0)
    choice = ckpt.resume(state)
    assert choice is not None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result.update(step=choice.step, tier=choice.tier, version=ckpt.version)
    result["resumed_vs_base"] = _same(_weights(model), weights[choice.step])
    for step in range(choice.step + 1, 7):
        _train(model, opt, step)
        ckpt.save(step, _state(model, opt, step))
    ckpt.drain()
    result["continued_vs_base_step6"] = _same(_weights(model), weights[6])
    result["promoted_step"] = ckpt.promoted_step
    ckpt.close()
    result["durable_steps"] = [g.step for g in CheckpointStore(f"{out}/durable", check_writable=False).generations()]


def _kill_self(call: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill(out: str, layout: str, result: dict) -> None:
    rank = dist.get_rank()
    faults = [Fault(op="write", path="step-00000002/__1_0.distcp", at=1, callback=_kill_self)] if rank == 1 else []
    durable = CheckpointStore(
        f"faulty://{out}/durable", {"target_protocol": "file", "faults": faults}, check_writable=False
    )
    model, opt = _model()
    ckpt = _ckpt(_folder(out, layout), durable, every_n_train_steps=2)
    for step in (1, 2):
        _train(model, opt, step)
        ckpt.save(step, _state(model, opt, step))
    try:
        ckpt.drain()
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 - the expected promotion error, reported
        result["error"] = f"{type(exc).__name__}: {exc}"
    listed = CheckpointStore(f"{out}/durable", check_writable=False).generations(include_uncommitted=True)
    result["durable"] = {str(g.step): g.committed for g in listed}
    result["local_steps"] = [g.step for g in ckpt.store.generations()]


def _kill_resume(out: str, layout: str, result: dict) -> None:
    model, opt = _model()
    ckpt = _ckpt(_folder(out, layout), f"{out}/durable", every_n_train_steps=2)
    state = _state(model, opt, 0)
    choice = ckpt.resume(state)
    assert choice is not None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result.update(step=choice.step, tier=choice.tier)
    for step in (3, 4):
        _train(model, opt, step)
        ckpt.save(step, _state(model, opt, step))
    ckpt.drain()
    result["promoted_step"] = ckpt.promoted_step
    ckpt.close()
    durable = CheckpointStore(f"{out}/durable", check_writable=False)
    result["durable_committed"] = [g.step for g in durable.generations()]
    result["durable_verified"] = durable.verify(4).ok


def _emergency(out: str, layout: str, result: dict) -> None:
    rank = dist.get_rank()
    model, opt = _model()
    ckpt = _ckpt(_folder(out, layout), f"{out}/durable", every_n_train_steps=100, preemption_signal=signal.SIGUSR1)
    result["stopped"] = None
    for step in range(1, 20):
        _train(model, opt, step)
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, to rank 1 only
        if ckpt.preemption_due():  # every rank, every step: any rank's signal counts
            result["where"] = ckpt.emergency_save(step, _state(model, opt, step), grace_s=120)
            result["stopped"] = step
            break
        if step % 2 == 0:
            ckpt.save(step, _state(model, opt, step))
    local = ckpt.store
    ckpt.close()
    result["local_steps"] = [g.step for g in local.generations()]
    result["durable_steps"] = [g.step for g in CheckpointStore(f"{out}/durable", check_writable=False).generations()]


def run_mode(out: str, mode: str) -> dict[str, Any]:
    name, _, layout = mode.partition(":")
    result: dict[str, Any] = {"rank": dist.get_rank()}
    folder = f"{out}/{name}-{layout}"
    os.makedirs(folder, exist_ok=True)
    if name == "equiv":
        _equiv(folder, layout, result)
    elif name in ("deleted", "damaged", "behind"):
        _fallback(folder, layout, result, name)
    elif name == "emergency":
        _emergency(folder, layout, result)
    elif name == "kill":
        _kill(folder, layout, result)
    elif name == "kill_resume":
        _kill_resume(f"{out}/kill-{layout}", layout, result)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return result


def main(out: str, modes: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)  # the promoter's warnings reach the test's output
    dist.init_process_group("gloo")
    for mode in modes:
        try:
            result = run_mode(out, mode)
            if mode.startswith("kill:"):
                print(f"RESULT {mode} " + json.dumps(result), flush=True)
                os._exit(0)  # the peer is dead: no clean shutdown
            dist.barrier()
        except Exception:  # noqa: BLE001 - reported under the mode's name
            print(f"RESULT {mode} " + json.dumps({"rank": dist.get_rank(), "exception": traceback.format_exc()}))
            sys.stdout.flush()
            os._exit(1)
        print(f"RESULT {mode} " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1], sys.argv[2].split(","))
