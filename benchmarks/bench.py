"""``lightning-async-ckpt bench``: every checkpointing approach on the same model, in the same run.

Modes: no checkpointing; Lightning ``ModelCheckpoint`` (synchronous); ``AsyncCheckpointIO`` + ``ModelCheckpoint``;
this library's ``StagedCheckpointIO`` plugin + ``ModelCheckpoint`` (``ours_checkpoint_io``);
torch DCP ``async_save`` (thread upload, default stager; and ``DefaultStager`` with async staging); this library
copy-at-cut; this library with fenced deferral. Beside them, the physical floors: memory-copy bandwidth (the staging
floor), raw sequential write with fsync (the persist floor) and, on CUDA, device-to-host bandwidth.

Per mode: median step time and overhead against no checkpointing; training-thread blocking per checkpoint (median,
max), measured as the extra time of the checkpoint step and the step after it; cut-to-committed latency; bytes;
peak RSS above the mode's start and peak retained staging bytes; persist throughput.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch

__all__ = ["build_parser", "main"]


def _load_modes() -> Any:
    """``_bench_modes.py`` beside this file (``bench`` is loaded by path, so it is not on ``sys.path``)."""
    name = "lightning_async_ckpt_bench_modes"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_bench_modes.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_modes = _load_modes()
MODE_SETUPS = _modes.MODE_SETUPS
ModeContext = _modes.ModeContext
ModeResult = _modes.ModeResult
ModeSetup = _modes.ModeSetup
StepTimer = _modes.StepTimer
# This library's own modes: one of them failing is a bug here (exit 1); a peer library failing is a result.
OWN_MODES = ("ours_copy", "ours_defer", "ours_checkpoint_io")


class _RssSampler:
    """Samples this process's RSS on a named thread; ``peak`` is above the value at start."""

    def __init__(self, interval: float = 0.01) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.base = self._proc.memory_info().rss
        self.peak = 0
        self._thread = threading.Thread(target=self._run, name="lightning_async_ckpt-bench-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._proc.memory_info().rss - self.base)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 1e6


def _floors(nbytes: int, folder: str, device: str) -> dict[str, float]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy = nbytes / (time.perf_counter() - t0) / 1e6
    path = os.path.join(folder, "raw-write.bin")
    data = memoryview(src.numpy())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(0, nbytes, 8 << 20):
            f.write(data[i : i + (8 << 20)])
        f.flush()
        os.fsync(f.fileno())
    raw_write = nbytes / (time.perf_counter() - t0) / 1e6
    os.unlink(path)
    out = {"memcpy_mbps": memcpy, "raw_write_fsync_mbps": raw_write}
    if hasattr(os, "O_DIRECT"):
        import mmap

        chunk = mmap.mmap(-1, 8 << 20)
        view = memoryview(chunk)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        for i in range(0, nbytes - (8 << 20) + 1, 8 << 20):
            view[:] = data[i : i + (8 << 20)]
            os.write(fd, view)
        os.fsync(fd)
        os.close(fd)
        out["raw_direct_fsync_mbps"] = (nbytes - nbytes % (8 << 20)) / (time.perf_counter() - t0) / 1e6
        view.release()
        chunk.close()
        os.unlink(path)
    if device == "cuda":
        gpu = src.cuda()
        for pinned in (True, False):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            host.copy_(gpu)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(gpu, non_blocking=pinned)
            torch.cuda.synchronize()
            out[f"d2h_{'pinned' if pinned else 'pageable'}_mbps"] = nbytes / (time.perf_counter() - t0) / 1e6
    return out


def _build(args: argparse.Namespace):
    import lightning.pytorch as pl
    from torch import nn

    width = args.width
    layers = max(1, int(args.param_mb * 1e6 / 4 / (width * width + width)))

    class BenchModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    return BenchModel, layers


def _run_mode(mode: str, args: argparse.Namespace, folder: str, model_cls, state0: dict) -> ModeResult:
    import lightning.pytorch as pl

    result = ModeResult(mode=mode)
    target = os.path.join(folder, mode)
    os.makedirs(target, exist_ok=True)
    model = model_cls()
    model.load_state_dict(state0)
    if args.device == "cuda":
        model = model.cuda()
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * 4, args.width))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    timer = StepTimer()
    ckpt_steps = set(range(args.every, args.steps + 1, args.every))
    setup = MODE_SETUPS[mode](ModeContext(args=args, target=target, ckpt_steps=ckpt_steps))
    sampler = _RssSampler()
    try:
        trainer = pl.Trainer(
            accelerator=args.device,
            devices=1,
            max_steps=args.steps,
            callbacks=[timer.callback, *setup.callbacks],
            plugins=setup.plugins or None,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=setup.checkpointing,
            num_sanity_val_steps=0,
        )
        t_fit = time.perf_counter()
        trainer.fit(model, loader)
        t_sync = time.perf_counter()
        if args.durable_wall:
            os.sync()  # every mode's files durable before the clock stops (AsyncCheckpointIO leaves them in cache)
        fit_s = time.perf_counter() - t_fit
        result.sync_s = time.perf_counter() - t_sync
    finally:
        result.peak_rss_mb = sampler.stop()
    times = timer.step_times()[1:]  # the first step includes warm-up
    result.step_times = times
    # step index i (0-based after dropping the first) is global step i + 2 at its end
    affected = {s - 2 for s in ckpt_steps} | {s - 1 for s in ckpt_steps}
    clean = [t for i, t in enumerate(times) if i not in affected]
    result.median_step_s = statistics.median(clean or times)
    result.mean_step_s = statistics.fmean(times)
    blocking = []
    for s in sorted(ckpt_steps):
        pair = [times[i] for i in (s - 2, s - 1) if 0 <= i < len(times)]
        if len(pair) == 2:
            blocking.append(max(0.0, sum(pair) - 2 * result.median_step_s))
    if mode != "none" and blocking:
        result.blocking_median_s = statistics.median(blocking)
        result.blocking_max_s = max(blocking)
        result.checkpoints = len(blocking)
    setup.finish(result, [os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(target) for f in fs])
    result.fit_s = fit_s
    result.note = f"fit {fit_s:.1f}s" + (f"; per checkpoint {[round(b, 3) for b in blocking]} s" if blocking else "")
    del trainer, model
    gc.collect()
    return result


def _run_mode_or_record(mode: str, args: argparse.Namespace, folder: str, model_cls, state0: dict) -> ModeResult:
    """Run one mode; a mode that raises is recorded with its error and the run goes on with the next one."""
    try:
        return _run_mode(mode, args, folder, model_cls, state0)
    except Exception as exc:  # noqa: BLE001 - a peer library's failure is a result of the comparison, not fatal
        print(f"# {mode}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        gc.collect()
        return ModeResult(mode=mode, error=f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def _markdown(results: list[ModeResult], floors: dict[str, float], machine: str, args: argparse.Namespace) -> str:
    def f(v: float | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return "–" if v is None else fmt.format(v * scale)

    lines = [
        f"Machine: {machine}. Model: {args.param_mb:.0f} MB of fp32 parameters (+ Adam state, about 3x on disk), "
        f"width {args.width}, batch {args.batch}, {args.steps} steps, a checkpoint every {args.every} steps, "
        f"device {args.device}.",
        "",
        "Floors: " + ", ".join(f"{k} {v:,.0f}" for k, v in floors.items()),
        "",
        f"| mode (torch {torch.__version__}) | median step s | mean step s | overhead vs none % |"
        " overhead vs own steps % | blocking/ckpt median s | max s | reported blocking s | cut→committed s | MB | peak RSS MB | peak retained MB | persist MB/s |"
        " error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error is not None:
            cells = " | ".join(["–"] * 12)
            lines.append(f"| {r.mode} | {cells} | FAILED: {r.error.replace('|', '/')} |")
            continue
        lines.append(
            f"| {r.mode} | {f(r.median_step_s)} | {f(r.mean_step_s)} | {f(r.overhead_pct, 1, '{:.1f}')} | "
            f"{f(r.own_overhead_pct, 1, '{:.1f}')} | {f(r.blocking_median_s)} | "
            f"{f(r.blocking_max_s)} | {f(r.reported_blocking_s, 1, '{:.4f}')} | {f(r.cut_to_committed_s)} | "
            f"{f(r.bytes, 1e-6, '{:.0f}')} | {r.peak_rss_mb:.0f} | {f(r.peak_retained_mb, 1, '{:.0f}')} | "
            f"{f(r.persist_mbps, 1, '{:.0f}')} | |"
        )
    return "\n".join(lines)


def _one_baseline(results: list[ModeResult]) -> list[ModeResult]:
    """The table's rows: the baseline's runs (first and last, against drift) as one row of their means."""
    runs = [r for r in results if r.mode == "none" and r.error is None]
    if len(runs) < 2:
        return results
    merged = replace(
        runs[0],
        median_step_s=statistics.fmean(r.median_step_s for r in runs),
        mean_step_s=statistics.fmean(r.mean_step_s for r in runs),
        peak_rss_mb=max(r.peak_rss_mb for r in runs),
    )
    out, placed = [], False
    for r in results:
        if r.mode == "none" and r.error is None:
            if not placed:
                out.append(merged)
                placed = True
            continue
        out.append(r)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bench`` (every flag has a help text)."""
    parser = argparse.ArgumentParser(
        prog="lightning-async-ckpt bench",
        description=__doc__.splitlines()[0],
        epilog="A mode that raises is recorded with its error (JSON and table) and the run goes on; the exit "
        f"status is 1 only when one of this library's modes ({', '.join(OWN_MODES)}) failed.",
    )
    parser.add_argument(
        "--param-mb", type=float, default=333.0, help="fp32 parameter MB of the model (Adam adds 2x; default 333)"
    )
    parser.add_argument("--width", type=int, default=2048, help="width of each square Linear layer (default 2048)")
    parser.add_argument("--batch", type=int, default=8, help="batch size; sets the step time (default 8)")
    parser.add_argument("--steps", type=int, default=95, help="training steps per mode (default 95)")
    parser.add_argument("--every", type=int, default=30, help="checkpoint every N training steps (default 30)")
    parser.add_argument(
        "--modes",
        default=",".join(MODE_SETUPS),
        help=f"comma-separated subset of {','.join(MODE_SETUPS)} (default: all; 'none' also runs last)",
    )
    parser.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=("cpu", "cuda"),
        help="where the model trains (default: cuda when available)",
    )
    parser.add_argument(
        "--upload-nice",
        type=int,
        default=0,
        help="nice value of this library's upload thread, 0-19 (default 0: unchanged)",
    )
    parser.add_argument(
        "--max-outstanding", type=int, default=1, help="this library's saves in flight at once (default 1)"
    )
    parser.add_argument(
        "--json", default="bench-results.json", help="JSON file for every figure (default bench-results.json)"
    )
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument(
        "--preset",
        default=None,
        choices=("lightning-cpu",),
        help="run a named comparison instead (lightning-cpu: 4 x Linear(4096) + Adam, a checkpoint every 4 of 40 "
        "steps, the wall clock stopped after os.sync(); none / ModelCheckpoint / AsyncCheckpointIO / this library, "
        "interleaved; see _bench_preset.py)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of a --preset (default 3)")
    parser.add_argument(
        "--durable-wall",
        action="store_true",
        help="stop each fit's wall clock only after os.sync(), so every mode's checkpoints are durable (a --preset "
        "always does)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a markdown table and writes a JSON file. Returns the exit code."""
    if (sys.argv[1:] if argv is None else argv)[:1] == ["sharded"]:
        # ``bench sharded ...``: the sharded modes on 2 CPU ranks (``_bench_sharded.py`` beside this file).
        spec = importlib.util.spec_from_file_location(
            "lac_bench_sharded", Path(__file__).with_name("_bench_sharded.py")
        )
        sharded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sharded)
        return sharded.main((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["recovery"]:
        # ``bench recovery ...``: restore time per tier, commit latency, goodput under preemptions.
        spec = importlib.util.spec_from_file_location(
            "lac_bench_recovery", Path(__file__).with_name("_bench_recovery.py")
        )
        recovery = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(recovery)
        return recovery.run_recovery((sys.argv[1:] if argv is None else argv)[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None:
        if args.repeats < 1:
            parser.error("need --repeats >= 1")
        spec = importlib.util.spec_from_file_location("lac_bench_preset", Path(__file__).with_name("_bench_preset.py"))
        preset = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(preset)
        runner = SimpleNamespace(_modes=_modes, _build=_build, _floors=_floors, _run_mode=_run_mode)
        defaults = {k: parser.get_default(k) for k in vars(args)}
        return preset.run_preset(runner, args, defaults)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODE_SETUPS)
    if unknown or args.every < 1 or args.steps <= args.every or args.param_mb <= 0:
        parser.error(
            f"bad arguments: unknown modes {sorted(unknown)}"
            if unknown
            else "need --param-mb > 0, --every >= 1 and --steps > --every"
        )
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    folder = args.dir or tempfile.mkdtemp(prefix="lac-bench-")
    os.makedirs(folder, exist_ok=True)
    machine = (
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}"
    )
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    try:
        torch.manual_seed(0)
        model_cls, layers = _build(args)
        state0 = {k: v.clone() for k, v in model_cls().state_dict().items()}
        nbytes = sum(v.numel() * v.element_size() for v in state0.values()) * 3
        floors = _floors(nbytes, folder, args.device)
        print(f"# {layers} layers, about {nbytes / 1e6:.0f} MB per checkpoint; floors (MB/s): {floors}", flush=True)
        results = []
        # The baseline runs first and last: these machines drift, and one baseline would favour whichever mode
        # ran under the same conditions.
        order = [*modes, "none"] if "none" in modes and len(modes) > 1 else modes
        for i, mode in enumerate(order, start=1):
            print(f"# [{i}/{len(order)}] {mode}: running {args.steps} steps ...", flush=True)
            r = _run_mode_or_record(mode, args, folder, model_cls, state0)
            shutil.rmtree(os.path.join(folder, mode), ignore_errors=True)
            results.append(r)
            if r.error is None:
                print(
                    f"# {mode}: median step {r.median_step_s:.3f}s, blocking {r.blocking_median_s}, {r.note}",
                    flush=True,
                )
        end = _floors(nbytes, folder, "cpu")
        floors["raw_write_fsync_mbps_end"] = end["raw_write_fsync_mbps"]
        if "raw_direct_fsync_mbps" in end:
            floors["raw_direct_fsync_mbps_end"] = end["raw_direct_fsync_mbps"]
        # Overhead: mean step time over every step (checkpoint steps included) against no checkpointing, and
        # against the same run's steps away from checkpoints (the checkpoint's own cost, free of drift).
        baselines = [r.mean_step_s for r in results if r.mode == "none" and r.error is None]
        base = statistics.fmean(baselines) if baselines else None
        for r in results:
            if base and r.mode != "none" and r.error is None:
                r.overhead_pct = 100.0 * (r.mean_step_s - base) / base
            if r.mode != "none" and r.median_step_s and r.error is None:
                r.own_overhead_pct = 100.0 * (r.mean_step_s - r.median_step_s) / r.median_step_s
        table = _markdown(_one_baseline(results), floors, machine, args)
        print(table)
        payload = {
            "machine": machine,
            "torch": torch.__version__,
            "args": vars(args),
            "floors": floors,
            "results": [asdict(r) for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(table + "\n")
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 1 if any(r.error is not None and r.mode in OWN_MODES for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
