"""The peer part of ``bench recovery``: two DDP ranks on CPU, each its own "node" with its own local folder.

After a first fit (``replicas=1``: rank 0's local generations are copied to rank 1's folder), the ranks are restarted
with ``ckpt_path="last"`` three ways, interleaved: both folders intact (local), rank 0's folder deleted (its
generation comes from rank 1 over the replica group) and both deleted (from moto S3). Three times per restart:

* from process start (the ``Popen`` of both ranks) to the end of the first training step of both;
* from the fit's start (before the ``Trainer``) to it: DDP set-up, the lookup, the restore, the load;
* from the checkpoint lookup on: the worker times Lightning's ``"last"`` lookup from its start (both ranks past the
  process group's set-up and a barrier, so the DDP set-up common to the three is left out): the ranks' agreement on a
  step, the copy from a peer or the read from durable storage with its verification, Lightning's load, the first
  step. This is what the single-process restores report as "lookup + load + first step".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _recovery_common import ENV, HERE, events, free_port, stores

SCENARIOS = ("local", "peer", "durable")


def spawn_ranks(config: dict[str, Any], world: int = 2) -> tuple[list[subprocess.Popen], float]:
    """Start ``world`` worker processes as the ranks of one DDP run; returns them and the start time."""
    port = free_port()
    t = time.time()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **ENV)
        env.update(WORLD_SIZE=str(world), RANK=str(rank))
        err = open(config["events"].replace("{rank}", str(rank)) + ".err", "a")  # noqa: SIM115 - the child owns it
        argv = [sys.executable, str(HERE / "_recovery_worker.py"), json.dumps(config)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs, t


def wait_all(procs: list[subprocess.Popen], what: str, pattern: str) -> None:
    """Wait for every rank; a failed one raises with the tail of its error output (the others are killed)."""
    try:
        for rank, proc in enumerate(procs):
            if proc.wait(timeout=900):
                err = Path(pattern.replace("{rank}", str(rank)) + ".err").read_text()[-2000:]
                raise RuntimeError(f"{what}: rank {rank} exited {proc.returncode}: {err}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def measure_peer(base: dict[str, Any], folder: str, options: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Restart to the first step with both folders intact (local), rank 0's deleted (peer), both deleted (durable).

    Returns, per scenario, seconds from process start (``<scenario>``), from the fit's start (``<scenario> fit``)
    and from the lookup (``<scenario> lookup``).
    """
    where = stores(folder, options, "peer")
    local = os.path.join(folder, "peer-local")
    cfg = {**base, "mode": "ddp_tiers", "dirpath": where["moto"][0], "storage_options": options}
    cfg |= {"local_dirpath": local, "local_every": base["every"]}
    pattern = os.path.join(folder, "peer-prep-{rank}.jsonl")
    procs, _ = spawn_ranks({**cfg, "events": pattern, "max_steps": base["every"]})
    wait_all(procs, "peer prepare", pattern)
    for rank in (0, 1):
        shutil.copytree(f"{local}-rank{rank}", f"{local}-saved{rank}")
    out: dict[str, list[float]] = {f"{s}{k}": [] for s in SCENARIOS for k in ("", " fit", " lookup")}
    for r in range(repeats):
        for scenario in SCENARIOS:
            for rank in (0, 1):
                shutil.rmtree(f"{local}-rank{rank}", ignore_errors=True)
                if scenario == "local" or (scenario == "peer" and rank == 1):
                    shutil.copytree(f"{local}-saved{rank}", f"{local}-rank{rank}")
            pattern = os.path.join(folder, f"peer-{scenario}-{r}-{{rank}}.jsonl")
            procs, t_spawn = spawn_ranks({**cfg, "events": pattern, "max_steps": base["every"] + 1, "resume": True})
            wait_all(procs, f"peer restore ({scenario})", pattern)
            firsts, fits, lookups = [], [], []
            for rank in (0, 1):
                evs = events(pattern.replace("{rank}", str(rank)))
                first = next(e for e in evs if e["event"] == "step")
                if first["step"] != base["every"] + 1:
                    raise RuntimeError(f"{scenario}: rank {rank} did not resume from step {base['every']}: {first}")
                firsts.append(first["t"])
                fits.append(next(e for e in evs if e["event"] == "resume")["t"])
                lookups.append(next(e for e in evs if e["event"] == "lookup")["t"])
            out[scenario].append(max(firsts) - t_spawn)
            # From the fit's start (DDP set-up, the ranks' agreement, a peer's copy, the load) to the first step.
            out[f"{scenario} fit"].append(max(firsts) - min(fits))
            # From the lookup on (agreement, copy or read and verify, load, first step of both ranks).
            out[f"{scenario} lookup"].append(max(firsts) - min(lookups))
    return out
