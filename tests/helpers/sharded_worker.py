"""One rank of the sharded-checkpoint tests: raw FSDP2 ``fully_shard`` on CPU (gloo) with ``ShardedCheckpointer``.

Usage: ``python sharded_worker.py <out> <mode>[,<mode>...]`` under ``tests.helpers.dist.launch_ranks``. The modes run
one after the other in this one pair of processes (the ranks' imports and start-up are most of a launch's time),
each from a fresh seeded model in its own folder ``<out>/<mode>`` and its own ``ShardedCheckpointer`` (own gloo
group), followed by a barrier. Each prints one ``RESULT <mode> {json}``; a mode that raises prints
``RESULT <mode> {"rank": r, "exception": "<traceback>"}`` and the process exits with status 1 without running the
modes after it (the peer then fails in its next collective and reports that too; nothing waits for a timeout).

Modes:
    ok: save steps 2 and 3 asynchronously (the weights change right after each cut) and, before each, a synchronous
        ``dcp.save`` of the same state into ``sync-<step>`` for comparison.
    fault: rank 1's data file fails to open at the second save: both ranks must raise at ``drain``; the step-1
        generation stays ``latest()``; a third save commits again.
    replicated: no sharding (every rank holds the same state, as under DDP): DCP's dedup gives each rank a slice.
    load: load ``one/step-00000001`` (written by one process, before the launch) into the FSDP2 model on two ranks;
        rank 0 writes the full model and optimizer state it then holds to ``loaded.pt``.
    slow: rank 1's storage write stalls until both ranks trained a step after the save (a file barrier): no
        training thread waits for it, and the save commits after it.
    fenced: ``attach`` installs the fences: parameters and Adam state are staged while the next step's forward and
        backward run; each generation equals a synchronous ``dcp.save`` at the cut.
    kill: rank 1 SIGKILLs itself in the middle of writing its step-2 data file; rank 0 must raise at ``drain``
        (from the broken connection, not a timeout), and the step-1 generation stays ``latest()``. Rank 0 then
        leaves with ``os._exit(0)`` (its peer is dead), so ``kill`` can only be the last mode.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_async_ckpt.sharded import ShardedCheckpointer, ShardedSaveError
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.testing import Fault, register_faulty

register_faulty()  # this process names faulty:// URLs

#: The checkpoint groups' timeout. Every expected error here comes from an injected fault or a dead peer within
#: a fraction of a second; the tests check that it is that error (never a timeout) and that it came before this.
GROUP_TIMEOUT_S = 60.0
#: The kill mode's group timeout: still far below the default group's 30 min.
KILL_GROUP_TIMEOUT_S = 60.0


def _wait_for_file(path: str, timeout_s: float = 60.0) -> None:
    """A file barrier between the ranks (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def _kill_self(call: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def make_model() -> torch.nn.Module:
    """The model every test builds (seeded, so every rank and the test process agree)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, i: int) -> None:
    gen = torch.Generator().manual_seed(100 * i + rank)
    loss = model(torch.randn(4, 16, generator=gen)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _load(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=f"{out}/one/step-00000001")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, f"{out}/loaded.pt")


def _replicated(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    dcp.save(_state(model, opt), checkpoint_id=f"{out}/sync-1")
    if rank == 0:
        torch.save(model.state_dict(), f"{out}/full.pt")
    with ShardedCheckpointer(f"{out}/store", timeout_s=GROUP_TIMEOUT_S) as ckpt:
        handle = ckpt.save(1, _state(model, opt))
        handle.result(timeout=2 * GROUP_TIMEOUT_S)
    result["uploaded"] = {e.name: e.size for e in handle.uploaded.result().objects}


def _ok(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    ckpt = ShardedCheckpointer(f"{out}/store", timeout_s=GROUP_TIMEOUT_S)
    committed, blocked = [], []
    for step in (2, 3):
        _train_step(model, opt, rank, step)
        dcp.save(_state(model, opt), checkpoint_id=f"{out}/sync-{step}")
        handle = ckpt.save(step, _state(model, opt))
        handle.staged.result(timeout=60)  # no fences: everything was copied at the cut
        blocked.append(handle.blocked_s)
        _train_step(model, opt, rank, 100 + step)  # mutates the weights while the save is in flight
        manifest = handle.result(timeout=2 * GROUP_TIMEOUT_S)
        committed.append(manifest.step)
        result["uploaded"] = [e.name for e in handle.uploaded.result().objects]
    result["run_id"] = ckpt.store.run_id
    ckpt.close()
    result.update(committed=committed, blocked_s=blocked)


def _step_two_fails(
    out: str,
    rank: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    result: dict,
    faults: list,
    timeout_s: float,
) -> ShardedCheckpointer:
    """Step 1 commits; step 2 meets ``faults``: its error (if raised) and how long it took go into ``result``."""
    ckpt = ShardedCheckpointer(
        f"faulty://{out}/store", storage_options={"target_protocol": "file", "faults": faults}, timeout_s=timeout_s
    )
    result["group_timeout_s"] = timeout_s
    ckpt.save(1, _state(model, opt)).result(timeout=2 * GROUP_TIMEOUT_S)
    _train_step(model, opt, rank, 1)
    ckpt.save(2, _state(model, opt))
    start = time.monotonic()
    try:
        ckpt.drain()
    except ShardedSaveError as exc:
        result["error"] = str(exc)
    result["error_after_s"] = time.monotonic() - start
    return ckpt


def _fault(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    faults = [Fault(op="open", path="__1_0.distcp", at=2, error="oserror")]
    ckpt = _step_two_fails(out, rank, model, opt, result, faults, GROUP_TIMEOUT_S)
    ckpt.drain()  # raised once, then cleared
    latest = CheckpointStore(out + "/store", check_writable=False).latest()
    result["latest_after_failure"] = latest.step if latest else None
    dist.barrier()
    ckpt.save(3, _state(model, opt)).result(timeout=2 * GROUP_TIMEOUT_S)
    ckpt.close()
    result["recovered"] = True


def _slow(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    gate = threading.Event()
    faults = [Fault(op="write", path="step-00000001/__1_0.distcp", stall=gate, stall_timeout_s=60)]
    ckpt = ShardedCheckpointer(
        f"faulty://{out}/store",
        storage_options={"target_protocol": "file", "faults": faults},
        timeout_s=GROUP_TIMEOUT_S,
    )
    handle = ckpt.save(1, _state(model, opt))
    _train_step(model, opt, rank, 1)  # the training goes on while rank 1's storage is stalled
    result["committed_while_training"] = handle.committed.done()
    open(f"{out}/trained-{rank}", "w").close()
    if rank == 1:
        _wait_for_file(f"{out}/trained-0")
        gate.set()  # rank 1's write goes on only once both ranks trained past the save
    result["committed"] = handle.result(timeout=2 * GROUP_TIMEOUT_S).step
    ckpt.close()


def _fenced(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    ckpt = ShardedCheckpointer(f"{out}/store", timeout_s=GROUP_TIMEOUT_S)
    ckpt.attach(model, opt)
    result.update(committed=[], deferred=[], sync=[])
    for step in (2, 3):
        _train_step(model, opt, rank, step)
        dcp.save(_state(model, opt), checkpoint_id=f"{out}/sync-{step}")
        handle = ckpt.save(step, _state(model, opt))
        _train_step(model, opt, rank, 100 + step)  # forward/backward overlap the staging; the step waits
        result["committed"].append(handle.result(timeout=2 * GROUP_TIMEOUT_S).step)
        result["deferred"].append(handle.deferred_bytes)
        result["sync"].append(handle.sync_bytes)
    ckpt.close()


def _kill(out: str, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict) -> None:
    faults = [Fault(op="write", path="step-00000002/__1_0.distcp", at=2, callback=_kill_self)]
    ckpt = _step_two_fails(out, rank, model, opt, result, faults, KILL_GROUP_TIMEOUT_S)
    latest = CheckpointStore(out + "/store", check_writable=False).latest()
    result["latest_after_failure"] = latest.step if latest else None
    ckpt.close()


MODES: dict[str, Callable[[str, int, torch.nn.Module, torch.optim.Optimizer, dict], None]] = {
    "ok": _ok,
    "fault": _fault,
    "replicated": _replicated,
    "load": _load,
    "slow": _slow,
    "fenced": _fenced,
    "kill": _kill,
}


def _report(mode: str, result: dict[str, Any]) -> None:
    print(f"RESULT {mode} " + json.dumps(result), flush=True)


def run_mode(out: str, mode: str) -> dict[str, Any]:
    """Run one mode from a fresh seeded model (sharded unless ``replicated``) after one training step."""
    rank = dist.get_rank()
    os.makedirs(out, exist_ok=True)
    model = make_model()
    if mode != "replicated":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model, opt, 0 if mode == "replicated" else rank, 0)  # replicated: the same data on every rank
    result: dict[str, Any] = {"rank": rank}
    MODES[mode](out, rank, model, opt, result)
    return result


def main(out: str, modes: list[str]) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes) or ("kill" in modes and modes[-1] != "kill"):
        raise SystemExit(f"bad modes {modes!r}: known ones are {sorted(MODES)}, each once, 'kill' last")
    dist.init_process_group("gloo")
    for mode in modes:
        try:
            result = run_mode(os.path.join(out, mode), mode)
            if mode == "kill":
                # The peer is dead: the default group cannot barrier or shut down cleanly; report and leave.
                _report(mode, result)
                os._exit(0)
            dist.barrier()  # the next mode starts on both ranks together
        except Exception:  # noqa: BLE001 - any failure of a mode is reported under its name
            _report(mode, {"rank": dist.get_rank(), "exception": traceback.format_exc()})
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # no clean shutdown: the peer may be inside a collective of this mode
        _report(mode, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1], sys.argv[2].split(","))
