"""``lightning-async-ckpt bench sharded``: sharded checkpoints on 2 CPU ranks (gloo, raw FSDP2), in one run.

Modes, all on the same FSDP2 model (``fully_shard`` per Linear layer) and the same training loop, one after the
other in the same two processes:

- ``none``: no checkpoint (the step-time baseline; it runs first and last);
- ``ours_fenced``: :class:`~lightning_async_ckpt.sharded.ShardedCheckpointer` with ``attach`` (fenced staging:
  parameters and optimizer state are staged while the next forward/backward run);
- ``ours_cut``: the same without fences (every local shard copied at the cut);
- ``dcp_async_thread``: ``torch.distributed.checkpoint.async_save`` (thread), on a gloo group of its own;
- ``dcp_async_process``: ``async_save(..., async_checkpointer_type=PROCESS)``, where the installed torch offers it
  (detected), with a bounded wait: a save that does not finish is reported, not waited for;
- the raw write floor: both ranks write their share of the same bytes at once (buffered write, fsync), measured
  before the modes and after them.

Per mode and rank: training-thread blocking per checkpoint (the ``save`` call including ``get_state_dict``, plus
the fence waits it caused, plus any wait for the previous save when the next was due), cut-to-committed time,
bytes on disk, and the aggregate persist throughput (bytes on disk of one checkpoint, all ranks, divided by the
slowest rank's cut-to-committed time: staging, planning, writing and the commit all count), twice: for the saves
taken while training goes on (the background work shares the cores with training), and for ``--idle`` more saves
after the training loop, each waited for with nothing else running ("idle": the pipeline's own throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

MODES = ("none", "ours_fenced", "ours_cut", "dcp_async_thread", "dcp_async_process")
OWN = ("ours_fenced", "ours_cut")


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _raw_floor(dist: Any, nbytes: int, folder: str, rank: int) -> float:
    """Aggregate MB/s of both ranks writing ``nbytes`` each at once, slowest rank's time; the faster of a buffered
    write + fsync and (where the OS has it) an ``O_DIRECT`` write + fsync: the fastest way to land these bytes."""
    import mmap

    import torch

    data = memoryview(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy())
    path = os.path.join(folder, f"raw-{rank}.bin")
    chunk = 8 << 20
    rates = []
    for direct in (False, True) if hasattr(os, "O_DIRECT") else (False,):
        dist.barrier()
        t0 = time.perf_counter()
        written = nbytes
        if direct:
            aligned = mmap.mmap(-1, chunk)
            view = memoryview(aligned)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
            written = nbytes - nbytes % chunk
            for i in range(0, written, chunk):
                view[:] = data[i : i + chunk]
                os.write(fd, view)
            os.fsync(fd)
            os.close(fd)
            view.release()
            aligned.close()
        else:
            with open(path, "wb") as f:
                for i in range(0, nbytes, chunk):
                    f.write(data[i : i + chunk])
                f.flush()
                os.fsync(f.fileno())
        elapsed = time.perf_counter() - t0
        os.unlink(path)
        times = [None, None]
        dist.all_gather_object(times, elapsed)
        rates.append(2 * written / max(times) / 1e6)
    return max(rates)


def _rank(args: argparse.Namespace) -> None:  # noqa: C901 - one loop per mode, kept together for readability
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_async_ckpt.sharded import ShardedCheckpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    step()
    local_bytes = sum(
        (t._local_tensor if hasattr(t, "_local_tensor") else t).nbytes for t in _tensors(state()) if t.dim() > 0
    )
    dcp_group = dist.new_group(backend="gloo")
    has_process = _has_process_type()
    out: dict[str, Any] = {"rank": rank, "local_state_mb": local_bytes / 1e6, "modes": {}}
    out["floor_mbps"] = [_raw_floor(dist, local_bytes, args.dir, rank)]
    modes = [m for m in args.modes if m != "none"]
    for mode in ["none", *modes, "none"]:
        if mode == "dcp_async_process" and not has_process:
            out["modes"][mode] = {"error": "this torch has no AsyncCheckpointerType.PROCESS"}
            continue
        target = os.path.join(args.dir, f"{mode}")
        ckpt = None
        if mode.startswith("ours"):
            ckpt = ShardedCheckpointer(f"{target}/store", timeout_s=args.timeout)
            if mode == "ours_fenced":
                ckpt.attach(model, opt)
        blocked: list[float] = []
        committed: list[float] = []
        sizes: list[int] = []
        steps: list[float] = []
        pending: list[tuple[Any, float]] = []  # (our handle or DCP's future, cut time)
        handles: list[Any] = []
        idle: list[float] = []
        error = None

        def finish(entry: tuple[Any, float], timeout: float) -> float:
            obj, cut = entry
            if hasattr(obj, "committed"):
                obj.result(timeout=timeout)
            else:
                getattr(obj, "upload_completion", obj).result(timeout=timeout)
            return time.perf_counter() - cut

        dist.barrier()
        try:
            idle_from = args.steps + 1
            for i in range(1, args.steps + 1 + (0 if mode == "none" else args.idle)):
                if i < idle_from:
                    t0 = time.perf_counter()
                    step()
                    steps.append(time.perf_counter() - t0)
                    if mode == "none" or i % args.every:
                        continue
                b0 = time.perf_counter()
                if pending:  # the next save is due: the previous one must be done (for every mode alike)
                    committed.append(finish(pending.pop(), args.timeout))
                cut = time.perf_counter()
                if ckpt is not None:
                    handle = ckpt.save(i, state())
                    if i < idle_from:
                        handles.append(handle)
                    pending.append((handle, cut))
                else:
                    kwargs: dict[str, Any] = {"checkpoint_id": f"{target}/step-{i}", "process_group": dcp_group}
                    if mode == "dcp_async_process":
                        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                        kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
                    pending.append((dcp.async_save(state(), **kwargs), cut))
                if i < idle_from:
                    blocked.append(time.perf_counter() - b0)
                else:
                    idle.append(finish(pending.pop(), args.timeout))
            if pending:
                committed.append(finish(pending.pop(), args.timeout))
        except (Exception, FutureTimeout) as exc:  # noqa: BLE001 - a failing mode is a result
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        # Our fenced saves also block the training thread at their fences (in the steps after the cut).
        fence_waits = [h.fence_wait_s for h in handles]
        if ckpt is not None:
            try:
                ckpt.close(timeout=args.timeout)
            except Exception as exc:  # noqa: BLE001
                error = error or f"{type(exc).__name__}: {exc}"
        if mode != "none" and error is None:
            for i in range(args.every, args.steps + 1, args.every):
                sizes.append(_folder_bytes(_gen_folder(target, mode, i)))
        dist.barrier()
        entry = out["modes"].setdefault(mode, {"runs": []}) if mode == "none" else {}
        row = {
            "steps_s": steps,
            "blocked_s": blocked,
            "committed_s": committed,
            "idle_s": idle,
            "bytes": sizes,
            "fence_wait_s": fence_waits,
            "error": error,
        }
        if mode == "none":
            entry["runs"].append(row)
        else:
            out["modes"][mode] = row
        shutil.rmtree(target, ignore_errors=True)
    out["floor_mbps"].append(_raw_floor(dist, local_bytes, args.dir, rank))
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    # A process-based async_save that never finished may have left a child behind: do not wait for it.
    os._exit(0)


def _gen_folder(target: str, mode: str, step: int) -> str:
    return f"{target}/store/step-{step:08d}" if mode.startswith("ours") else f"{target}/step-{step}"


def _has_process_type() -> bool:
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return False
    return any(t.name == "PROCESS" for t in AsyncCheckpointerType)


def _tensors(obj: object) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _summarize(ranks: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Per mode: per-rank blocking (median over counted saves, the first is a warm-up), persist throughput."""
    base_steps = [s for r in ranks for run in r["modes"]["none"]["runs"] for s in run["steps_s"][1:]]
    base = _median(base_steps)
    floor_start = min(r["floor_mbps"][0] for r in ranks)
    floor_end = min(r["floor_mbps"][-1] for r in ranks)
    rows: dict[str, Any] = {}
    for mode in ranks[0]["modes"]:
        if mode == "none":
            continue
        per = [r["modes"][mode] for r in ranks]
        error = next((p.get("error") for p in per if p.get("error")), None)
        if error is not None or not all(p.get("blocked_s") for p in per):
            rows[mode] = {"error": error or "no save finished"}
            continue
        # Per rank: blocking of each counted save = the save call (+ previous-save wait) + its fence waits.
        blocking = []
        for p in per:
            waits = p["fence_wait_s"] or [0.0] * len(p["blocked_s"])
            totals = [b + w for b, w in zip(p["blocked_s"], waits, strict=True)]
            blocking.append(_median(totals[1:] or totals))
        committed = [max(c) for c in zip(*[p["committed_s"] for p in per], strict=True)]
        disk = [sum(s) for s in zip(*[p["bytes"] for p in per], strict=True)]  # same folder on both ranks: /2
        disk_bytes = disk[-1] // len(per)
        # The first save is a warm-up; the last one of the loop is waited for after the last step (no training
        # after it), so it counts as neither; the idle saves come after the loop.
        training = committed[1:-1] or committed[1:] or committed
        persist = [disk_bytes / c / 1e6 for c in training]
        idle_s = [max(c) for c in zip(*[p["idle_s"] for p in per], strict=True)] or [committed[-1]]
        idle = disk_bytes / _median(idle_s) / 1e6
        floor = min(floor_start, floor_end)
        steps = [s for p in per for s in p["steps_s"][1:]]
        rows[mode] = {
            "blocking_ms_per_rank": [round(1000 * b, 1) for b in blocking],
            "cut_to_committed_s": round(_median(training), 3),
            "cut_to_committed_idle_s": round(_median(idle_s), 3),
            "disk_mb": round(disk_bytes / 1e6, 1),
            "persist_mbps": round(_median(persist), 1),
            "persist_pct_of_floor": round(100 * _median(persist) / floor, 1),
            "persist_idle_mbps": round(idle, 1),
            "persist_idle_pct_of_floor": round(100 * idle / floor, 1),
            "mean_step_s": round(statistics.fmean(steps), 4),
            "step_overhead_pct": round(100 * (statistics.fmean(steps) - base) / base, 1) if base else None,
        }
    ref = rows.get("dcp_async_thread", {}).get("blocking_ms_per_rank")
    for row in rows.values():
        if ref and "blocking_ms_per_rank" in row:
            row["blocking_vs_dcp_async_thread"] = [
                round(b / r, 3) if r else None for b, r in zip(row["blocking_ms_per_rank"], ref, strict=True)
            ]
    return {
        "base_step_s": base,
        "floor_mbps": [round(floor_start, 1), round(floor_end, 1)],
        "every": every,
        "rows": rows,
    }


def _markdown(summary: dict[str, Any], machine: str, args: argparse.Namespace, local_mb: float) -> str:
    lines = [
        f"Machine: {machine}. 2 ranks (gloo), raw FSDP2 `fully_shard`, {args.layers} x Linear({args.width}), Adam; "
        f"{local_mb:.0f} MB of model+optimizer state per rank; a checkpoint every {args.every} steps, "
        f"{args.steps} steps per mode (the first save of each mode is a warm-up, not counted). Raw write floor "
        f"(both ranks writing at once, the faster of buffered and O_DIRECT, fsync): "
        f"{summary['floor_mbps'][0]} MB/s before the modes, "
        f"{summary['floor_mbps'][1]} MB/s after.",
        "",
        "| mode | blocking per rank (ms, median) | x DCP async_save (thread) | on disk MB "
        "| cut to committed s (training / idle) | aggregate persist MB/s (training / idle) "
        "| % of raw floor (training / idle) | step overhead % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in summary["rows"].items():
        if "error" in r:
            lines.append(f"| {mode} | FAILED: {str(r['error']).replace('|', '/')} | | | | | | |")
            continue
        ratio = r.get("blocking_vs_dcp_async_thread") or ["-"]
        lines.append(
            f"| {mode} | {' / '.join(str(b) for b in r['blocking_ms_per_rank'])} | "
            f"{' / '.join(str(x) for x in ratio)} | {r['disk_mb']} | "
            f"{r['cut_to_committed_s']} / {r['cut_to_committed_idle_s']} | "
            f"{r['persist_mbps']} / {r['persist_idle_mbps']} | "
            f"{r['persist_pct_of_floor']} / {r['persist_idle_pct_of_floor']} | {r['step_overhead_pct']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the sharded benchmark on 2 local CPU ranks; print a markdown table, write a JSON file."""
    parser = argparse.ArgumentParser(prog="lightning-async-ckpt bench sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--width", type=int, default=1024, help="width of each square Linear layer (default 1024)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per rank; sets the step time (default 64)")
    parser.add_argument("--steps", type=int, default=24, help="training steps per mode (default 24)")
    parser.add_argument("--every", type=int, default=6, help="checkpoint every N steps (default 6)")
    parser.add_argument("--idle", type=int, default=2, help="saves after the training loop, nothing else running")
    parser.add_argument("--modes", default=",".join(m for m in MODES if m != "none"), help="comma-separated modes")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on any one save (default 120 s)")
    parser.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", default="bench-sharded.json", help="JSON file for every figure")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in (args.modes if isinstance(args.modes, str) else ",".join(args.modes)).split(",")]
    unknown = set(args.modes) - set(MODES)
    if unknown or args.every < 1 or args.steps < 2 * args.every:
        parser.error(f"unknown modes {sorted(unknown)}" if unknown else "need --every >= 1 and --steps >= 2 * --every")
    if args.rank_worker:
        _rank(args)
        return 0
    import psutil
    import torch

    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="lac-bench-sharded-")
    os.makedirs(args.dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    forwarded = [*forwarded, "--dir", args.dir, "--modes", ",".join(args.modes)]
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
            env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, *forwarded, "--rank-worker"],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        limit = 60 + 4 * args.timeout + 30 * args.steps
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=limit)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                print("a rank did not finish within the bound; killed", file=sys.stderr)
                return 1
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    ranks = []
    for text in outs:
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(text[-3000:], file=sys.stderr)
            return 1
        ranks.append(json.loads(lines[-1].removeprefix("RESULT ")))
    summary = _summarize(ranks, args.every)
    machine = (
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}, Python {platform.python_version()}"
    )
    table = _markdown(summary, machine, args, ranks[0]["local_state_mb"])
    print(table)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "args": {**vars(args)}, "summary": summary, "ranks": ranks}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 1 if any("error" in summary["rows"].get(m, {}) for m in OWN) else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
