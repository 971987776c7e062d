"""``bench recovery``: restore time per tier, commit latency per tier, and goodput under simulated preemptions.

Three parts, in one run, on one state (``--state-mb`` of model + Adam state: ``Linear(width, width)`` layers):

1. **Restore**: one checkpoint is written (a Lightning fit with ``AsyncCheckpointCallback``) to each store: the
   local tier (a folder on this disk), the durable tier on a moto S3 server on loopback, and ``slowfaulty://``
   (``faulty://`` over a local folder with ``--remote-mbps`` on reads and writes: a remote store's bandwidth).
   Then a fresh process (``_recovery_worker.py``) is started per store and per repeat, and the time from its
   start (the parent's ``Popen``) to the end of its first training step after the restore is measured, with the
   part from the checkpoint lookup on. Stores are measured interleaved, ``--repeats`` times.
2. **Commit latency**: the same state saved by ``AsyncCheckpointer`` (copy at the cut) to the local store and to
   moto S3 (and to ``slowfaulty://``), interleaved: time from ``save`` to the committed future. One checkpointer per
   store, as in training: its first save (pool allocated at the cut, threads and connections started) is reported
   apart, then ``--repeats`` saves each, every one after the previous save's retention ended.
   **Peer** (``--peer``, default on, ``_recovery_peer.py``): two DDP ranks on CPU, each its own "node" with its own
   local folder, ``replicas=1``; after a first fit, restarts with ``ckpt_path="last"`` and both folders intact, rank
   0's folder deleted (restored from its peer), or both deleted (from moto S3), interleaved; timed from process
   start, from the fit's start, and from the checkpoint lookup on (past the DDP set-up common to the three).
3. **Goodput**: a training run of ``--total-steps`` steps of ``--step-s`` simulated seconds each (a real step padded
   with a sleep), killed with ``SIGKILL`` every ``--preempt-every`` seconds of wall time from its start and
   restarted until it finishes, for ``ModelCheckpoint`` (blocking, to moto S3), this library with one tier (moto
   S3) and with two tiers (local folder + moto S3). A kill is a preemption without warning on the same node: the
   local folder survives. With ``--fork`` (default) every restart is forked from a process that imported torch,
   Lightning and the library once (part 1 measures the full start-up; on a loaded 2-core machine the imports alone
   took 20-50 s, the same for every mode, and would leave little training between kills). Goodput = ``total_steps * step_s / wall``. Beside it the recovery model's prediction
   (``tools/recovery_model.py``) from the measured commit latencies and start-up time.

The moto server runs in a process of its own (``_recovery_common.py``), as a remote store would, not in this one.
Every figure is printed as a markdown table; ``--json`` keeps them all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # the sibling modules (this file is loaded by path, from `bench`)

from _recovery_common import ENV as _ENV  # noqa: E402 - after the path above
from _recovery_common import MotoProcess  # noqa: E402
from _recovery_common import events as read_events  # noqa: E402
from _recovery_common import stores as make_stores  # noqa: E402

GOODPUT_MODES = ("model_checkpoint", "one_tier", "two_tiers")
TIERS = ("local", "moto", "faulty")


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``bench recovery``."""
    p = argparse.ArgumentParser(prog="lightning-async-ckpt bench recovery", description=__doc__.splitlines()[0])
    p.add_argument("--state-mb", type=float, default=100.0, help="model + Adam state, MB (default 100)")
    p.add_argument("--width", type=int, default=512, help="width of each Linear layer (default 512)")
    p.add_argument("--remote-mbps", type=float, default=50.0, help="slowfaulty:// read/write cap, MB/s (default 50)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the restore and commit parts")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"stores to restore from: subset of {','.join(TIERS)}")
    p.add_argument("--step-s", type=float, default=0.25, help="simulated seconds per training step (default 0.25)")
    p.add_argument("--every", type=int, default=20, help="durable checkpoint every N steps (default 20)")
    p.add_argument("--local-every", type=int, default=4, help="local-tier cut every N steps (default 4)")
    p.add_argument("--total-steps", type=int, default=120, help="steps of the goodput run (default 120)")
    p.add_argument("--preempt-every", type=float, default=20.0, help="wall seconds between kills (default 20; 0: none)")
    p.add_argument(
        "--goodput-modes", default=",".join(GOODPUT_MODES), help="subset of the goodput modes ('' skips the part)"
    )
    p.add_argument(
        "--peer", action=argparse.BooleanOptionalAction, default=True, help="the 2-rank DDP restore with replicas=1"
    )
    p.add_argument(
        "--fork",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="goodput restarts fork from a process that imported torch and Lightning once (default), instead of "
        "starting a fresh interpreter each time",
    )
    p.add_argument("--goodput-repeats", type=int, default=1, help="repeats of the goodput part, modes interleaved")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    return p


def _worker() -> Any:
    sys.path.insert(0, str(_HERE))
    import _recovery_worker

    return _recovery_worker


def _report() -> Any:
    sys.path.insert(0, str(_HERE))
    import _recovery_report

    return _recovery_report


def _spawn(config: dict[str, Any]) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **_ENV)
    t = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(_HERE / "_recovery_worker.py"), json.dumps(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(config["events"] + ".err", "a"),  # noqa: SIM115 - the child owns it
    )
    return proc, t


def _restore_config(base: dict[str, Any], stores: dict[str, Any], tier: str, tiers: list[str]) -> dict[str, Any]:
    """The restart of one store's restore. The local tier is restored as a two-tier job does (durable tier on moto,
    ``local_dirpath`` the local store: the lookup lists the durable tier, then reads and verifies the local
    generation); each has step ``every``, and no cut follows the first step (``local_every`` out of reach)."""
    uri, opts = stores[tier]
    if tier == "local" and "moto" in tiers:
        durable, durable_opts = stores["moto"]
        cfg = {**base, "mode": "two_tiers", "dirpath": durable, "storage_options": durable_opts}
        return cfg | {"local_dirpath": uri, "local_every": 10**9}
    return {**base, "mode": "one_tier", "dirpath": uri, "storage_options": opts}


def _restore_once(base: dict[str, Any], folder: str, tag: str) -> dict[str, float]:
    events = os.path.join(folder, f"restore-{tag}-{uuid.uuid4().hex[:6]}.jsonl")
    proc, t_spawn = _spawn({**base, "events": events, "max_steps": base["every"] + 1})
    if proc.wait(timeout=900):
        raise RuntimeError(f"restore from {tag} exited {proc.returncode}: {Path(events + '.err').read_text()[-2000:]}")
    evs = read_events(events)
    resume = next(e for e in evs if e["event"] == "resume")
    first = next(e for e in evs if e["event"] == "step")
    if not resume["ckpt_path"] or first["step"] != base["every"] + 1:
        raise RuntimeError(f"restore from {tag} did not resume from step {base['every']}: {resume}, {first}")
    lookup_start = resume["t"] - resume["lookup_s"]
    return {
        "total_s": first["t"] - t_spawn,
        "restore_s": first["t"] - lookup_start,
        "startup_s": lookup_start - t_spawn,
    }


def _state(layers: int, width: int) -> dict[str, Any]:
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).pow(2).mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def measure_commit(
    stores: dict[str, Any], layers: int, width: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds from ``save`` to committed, per store, interleaved, as training saves: one checkpointer per store.

    Its first save (staging pool allocated at the cut, threads and connections started) is returned apart and not
    counted; then ``repeats`` saves each. Retention of the previous generation runs on the upload thread after the
    committed future resolved: it ends before the next store's save starts, so no save waits behind another's.

    Returns:
        The timed saves per store, and the first save per store.
    """
    from lightning_async_ckpt import AsyncCheckpointer
    from lightning_async_ckpt.storage.store import CheckpointStore

    state = _state(layers, width)
    out: dict[str, list[float]] = {name: [] for name in stores}
    first: dict[str, float] = {}
    ckpts = {
        name: AsyncCheckpointer(CheckpointStore(f"{uri}-commit", options), keep_last=1)
        for name, (uri, options) in stores.items()
    }
    try:
        for r in range(repeats + 1):
            for name, ckpt in ckpts.items():
                t0 = time.perf_counter()
                ckpt.save(r + 1, state, defer=False).result(timeout=900)
                elapsed = time.perf_counter() - t0
                ckpt.drain()
                ckpt.upload_worker.submit(lambda: None).result(timeout=900)  # its retention ended
                if r == 0:
                    first[name] = elapsed
                else:
                    out[name].append(elapsed)
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    return out, first


class _Launcher:
    """Starts training processes: fresh ones (``Popen``), or forked by a zygote that imported everything once."""

    def __init__(self, fork: bool, folder: str) -> None:
        self.zygote = None
        if fork:
            env = dict(os.environ, OMP_NUM_THREADS="1", **_ENV)
            err = open(os.path.join(folder, "zygote.err"), "a")  # noqa: SIM115 - the zygote owns it
            argv = [sys.executable, str(_HERE / "_recovery_worker.py"), "--zygote"]
            self.zygote = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
            self.zygote.stdout.readline()  # READY

    def start(self, config: dict[str, Any]) -> tuple[Any, float]:
        """Start one; returns a handle for :meth:`poll` / :meth:`kill` and the start time."""
        if self.zygote is None:
            return _spawn(config)
        t = time.time()
        self.zygote.stdin.write((json.dumps(config) + "\n").encode())
        self.zygote.stdin.flush()
        return int(self.zygote.stdout.readline().split()[1]), t

    def poll(self, handle: Any) -> int | None:
        if self.zygote is None:
            return handle.poll()
        import select

        if not select.select([self.zygote.stdout], [], [], 0)[0]:
            return None
        return int(self.zygote.stdout.readline().split()[2])

    def kill(self, handle: Any) -> int:
        if self.zygote is None:
            handle.kill()
            return handle.wait()
        os.kill(handle, signal.SIGKILL)
        return int(self.zygote.stdout.readline().split()[2])

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.stdin.close()
            self.zygote.wait(timeout=60)


def measure_goodput(
    mode: str, base: dict[str, Any], args: argparse.Namespace, folder: str, launcher: _Launcher
) -> dict[str, Any]:
    """One run of ``mode`` to ``--total-steps`` under the kill schedule; goodput and what each restart cost."""
    events = os.path.join(folder, f"goodput-{mode}-{uuid.uuid4().hex[:6]}.jsonl")
    config = {**base, "mode": mode, "events": events, "max_steps": args.total_steps}
    t_begin = time.time()
    restarts: list[dict[str, float]] = []
    startups: list[float] = []
    kills = 0
    while True:
        seen = len(read_events(events))
        handle, t_spawn = launcher.start(config)
        deadline = t_begin + (kills + 1) * args.preempt_every if args.preempt_every > 0 else None
        code = None
        try:
            while code is None:
                code = launcher.poll(handle)
                if code is None and deadline is not None and time.time() >= deadline:
                    code = launcher.kill(handle)
                    kills += 1
                elif code is None:
                    time.sleep(0.05)
        finally:
            if code is None:  # interrupted: leave no training process behind
                launcher.kill(handle)
        evs = read_events(events)[seen:]
        steps = [e for e in evs if e["event"] == "step"]
        resumes = [e for e in evs if e["event"] == "resume"]
        if steps:
            restarts.append(
                {"first_step_s": steps[0]["t"] - t_spawn, "resumed_at": steps[0]["step"] - 1, "last": steps[-1]["step"]}
            )
        if resumes:  # start-up before the checkpoint lookup (a fork: no imports)
            startups.append(resumes[0]["t"] - resumes[0]["lookup_s"] - t_spawn)
        if code == 0:
            break
        if code != -signal.SIGKILL:  # the training failed: a result, reported with the tail of its error
            err = os.path.join(folder, "zygote.err") if launcher.zygote is not None else events + ".err"
            lines = [x for x in Path(err).read_text().splitlines() if "Error" in x]
            return {"mode": mode, "error": f"exited {code}: {lines[-1] if lines else '?'}", "preemptions": kills}
        if time.time() - t_begin > 40 * args.total_steps * args.step_s + 600:
            raise RuntimeError(f"{mode}: no progress under this kill schedule (make --preempt-every longer)")
    wall = time.time() - t_begin
    lost = sum(max(0, a["last"] - b["resumed_at"]) for a, b in zip(restarts, restarts[1:], strict=False))
    return {
        "mode": mode,
        "wall_s": wall,
        "goodput": args.total_steps * args.step_s / wall,
        "preemptions": kills,
        "lost_steps": lost,
        "restore_s": [r["first_step_s"] for r in restarts[1:]],
        "startup_s": startups,
    }


def _dump(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write what was measured so far (a later part that fails leaves the earlier ones on disk)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def run_recovery(argv: list[str]) -> int:
    """Run the three parts and print their tables. Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    modes = [m for m in args.goodput_modes.split(",") if m]
    if set(tiers) - set(TIERS) or set(modes) - set(GOODPUT_MODES) or args.repeats < 1 or args.total_steps <= args.every:
        parser.error("bad --tiers/--goodput-modes, or --repeats < 1, or --total-steps <= --every")
    os.environ.update(_ENV)
    os.environ[_worker().READ_CAP_ENV] = str(args.remote_mbps * 1e6)
    _worker().register_capped_filesystem()
    import logging

    import psutil
    import torch

    for name in ("lightning.pytorch", "werkzeug", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    layers = max(1, int(args.state_mb * 1e6 / 3 / 4 / (args.width * args.width + args.width)))
    state_mb = 3 * 4 * layers * (args.width * args.width + args.width) / 1e6
    folder = args.dir or tempfile.mkdtemp(prefix="lac-bench-recovery-")
    os.makedirs(folder, exist_ok=True)
    server = MotoProcess(os.path.join(folder, "moto.log"))  # its own process, as a remote store
    options = server.options
    os.environ["AWS_ENDPOINT_URL"] = options["endpoint_url"]  # Lightning's own loader opens s3:// without options
    base = {"width": args.width, "layers": layers, "step_s": args.step_s, "every": args.every}
    base |= {"local_every": args.local_every, "scratch": folder}
    result: dict[str, Any] = {"state_mb": state_mb, "args": vars(args)}
    load0 = os.getloadavg()[0]
    try:
        stores = make_stores(folder, options, "restore")
        worker = _worker()
        for tier in tiers:  # one checkpoint at step `every` in each store, written by the callback in-process
            uri, opts = stores[tier]
            prep = {**base, "mode": "one_tier", "dirpath": uri, "storage_options": opts, "max_steps": args.every}
            worker.run({**prep, "events": os.path.join(folder, f"prep-{tier}.jsonl"), "step_s": 0.0})
        restore: dict[str, list[dict[str, float]]] = {t: [] for t in tiers}
        for _ in range(args.repeats):
            for tier in tiers:
                restore[tier].append(_restore_once(_restore_config(base, stores, tier, tiers), folder, tier))
        result["restore"] = restore
        result["commit_s"], result["commit_first_s"] = measure_commit(
            {t: stores[t] for t in tiers}, layers, args.width, args.repeats
        )
        print(f"# restore: {restore}\n# commit: {result['commit_s']} (first: {result['commit_first_s']})", flush=True)
        _dump(args, result)
        if args.peer:
            from _recovery_peer import measure_peer

            result["peer"] = measure_peer(base, folder, options, args.repeats)
            print(f"# peer: {result['peer']}", flush=True)
            _dump(args, result)
        goodput = []
        launcher = _Launcher(args.fork, folder) if modes else None
        for repeat in range(args.goodput_repeats if modes else 0):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                gstores = make_stores(folder, options, f"goodput-{mode}-{repeat}")
                cfg = {**base, "dirpath": gstores["moto"][0], "storage_options": options}
                cfg["local_dirpath"] = gstores["local"][0]
                goodput.append(measure_goodput(mode, cfg, args, folder, launcher) | {"repeat": repeat + 1})
                print(f"# goodput {mode}: {goodput[-1]}", flush=True)
                _dump(args, result | {"goodput": goodput})
        result["goodput"] = goodput
        if launcher is not None:
            launcher.close()
    finally:
        server.stop()
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    result["machine"] = (
        f"{platform.machine()}, {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"torch {torch.__version__}; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    print(_report().markdown(result, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
