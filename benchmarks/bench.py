"""``lightning-async-ckpt bench``: every checkpointing approach on the same model, in the same run.

Modes: no checkpointing; Lightning ``ModelCheckpoint`` (synchronous); ``AsyncCheckpointIO`` + ``ModelCheckpoint``;
torch DCP ``async_save`` (thread upload, default stager; and ``DefaultStager`` with async staging); this library
copy-at-cut; this library with fenced deferral. Beside them, the physical floors: memory-copy bandwidth (the staging
floor), raw sequential write with fsync (the persist floor) and, on CUDA, device-to-host bandwidth.

Per mode: median step time and overhead against no checkpointing; training-thread blocking per checkpoint (median,
max), measured as the extra time of the checkpoint step and the step after it; cut-to-committed latency; bytes;
peak RSS above the mode's start and peak retained staging bytes; persist throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch

__all__ = ["main"]

MODES = (
    "none",
    "model_checkpoint",
    "async_checkpoint_io",
    "dcp_async_save",
    "dcp_async_staging",
    "ours_copy",
    "ours_defer",
)


@dataclass
class ModeResult:
    """Figures of one mode."""

    mode: str
    median_step_s: float = 0.0
    mean_step_s: float = 0.0
    overhead_pct: float | None = None
    own_overhead_pct: float | None = None
    blocking_median_s: float | None = None
    blocking_max_s: float | None = None
    reported_blocking_s: float | None = None
    cut_to_committed_s: float | None = None
    bytes: int | None = None
    peak_rss_mb: float = 0.0
    peak_retained_mb: float | None = None
    persist_mbps: float | None = None
    checkpoints: int = 0
    note: str = ""
    step_times: list[float] = field(default_factory=list)


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


class _StepTimer:
    """Records the start time of every training batch (it runs before the checkpoint callbacks)."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        timer = self

        class _Cb(Callback):
            lightning_async_ckpt_read_only = True  # it only reads the clock

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                timer.starts.append(time.perf_counter())

            def on_train_end(self, trainer, pl_module):
                timer.starts.append(time.perf_counter())

        self.starts: list[float] = []
        self.callback = _Cb()

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def _dcp_callback(folder: str, every: int, async_staging: bool, timings: dict[str, list]):
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class DcpAsync(Callback):
        """What a user writes today with DCP: async_save at the cut, wait for the previous save first."""

        def __init__(self) -> None:
            self.pending = None
            self.staging = None
            self.stager = None
            if async_staging:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                opts = StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=torch.cuda.is_available(),
                )
                self.stager = DefaultStager(opts)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.staging is not None:  # the source must not mutate before the copy is done
                t0 = time.perf_counter()
                self.staging.result()
                timings["fence"].append(time.perf_counter() - t0)
                self.staging = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % every:
                return
            t0 = time.perf_counter()
            if self.pending is not None:
                self.pending.result()
            model_sd, optim_sd = get_state_dict(pl_module, trainer.optimizers)
            t_req = time.time()
            kwargs: dict[str, Any] = {"checkpoint_id": os.path.join(folder, f"step-{step}")}
            if self.stager is not None:
                kwargs["async_stager"] = self.stager
            with contextlib.suppress(TypeError):
                resp = dcp.async_save({"model": model_sd, "optim": optim_sd}, no_dist=True, **kwargs)
            upload = getattr(resp, "upload_completion", resp)  # AsyncSaveResponse where the stager is async
            self.staging = getattr(resp, "staging_completion", None)
            upload.add_done_callback(lambda _f, t=t_req: timings["committed"].append(time.time() - t))
            self.pending = upload
            timings["cut"].append(time.perf_counter() - t0)

        def on_train_end(self, trainer, pl_module):
            if self.pending is not None:
                self.pending.result()
            if self.stager is not None:
                self.stager.close()

    return DcpAsync()


def _run_mode(mode: str, args: argparse.Namespace, folder: str, model_cls, state0: dict) -> ModeResult:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from lightning_async_ckpt.lightning import AsyncCheckpointCallback

    result = ModeResult(mode=mode)
    target = os.path.join(folder, mode)
    os.makedirs(target, exist_ok=True)
    model = model_cls()
    model.load_state_dict(state0)
    if args.device == "cuda":
        model = model.cuda()
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * 4, args.width))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    timer = _StepTimer()
    callbacks: list[Any] = [timer.callback]
    plugins: list[Any] = []
    committed_times: dict[str, list] = {"cut": [], "committed": [], "fence": []}
    ours = None
    if mode in ("model_checkpoint", "async_checkpoint_io"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=target,
                every_n_train_steps=args.every,
                save_top_k=-1,
                filename="{step}",
                save_on_train_epoch_end=False,
            )
        )
        if mode == "async_checkpoint_io":

            class _TimedIO(TorchCheckpointIO):
                def save_checkpoint(self, checkpoint, path, storage_options=None):
                    super().save_checkpoint(checkpoint, path, storage_options)
                    committed_times["committed"].append(time.time())

            plugins.append(AsyncCheckpointIO(_TimedIO()))
    elif mode.startswith("dcp"):
        callbacks.append(_dcp_callback(target, args.every, mode == "dcp_async_staging", committed_times))
    elif mode.startswith("ours"):
        ours = AsyncCheckpointCallback(
            dirpath=target,
            every_n_train_steps=args.every,
            defer=(mode == "ours_defer"),
            save_on_train_end=False,
            host_memory_budget=None,
            upload_nice=args.upload_nice,
            max_outstanding=args.max_outstanding,
        )
        callbacks.append(ours)
    sampler = _RssSampler()
    trainer = pl.Trainer(
        accelerator=args.device,
        devices=1,
        max_steps=args.steps,
        callbacks=callbacks,
        plugins=plugins or None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=mode in ("model_checkpoint", "async_checkpoint_io", "ours_copy", "ours_defer"),
        num_sanity_val_steps=0,
    )
    t_fit = time.perf_counter()
    trainer.fit(model, loader)
    fit_s = time.perf_counter() - t_fit
    result.peak_rss_mb = sampler.stop()
    times = timer.step_times()[1:]  # the first step includes warm-up
    result.step_times = times
    ckpt_steps = {s for s in range(args.every, args.steps + 1, args.every)}
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
    sizes = [os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(target) for f in fs]
    if mode == "model_checkpoint" or mode == "async_checkpoint_io":
        result.bytes = max(sizes) if sizes else None
    elif mode.startswith("dcp"):
        result.bytes = sum(sizes) // max(1, len(ckpt_steps)) if sizes else None
        result.reported_blocking_s = (
            statistics.median(
                [c + f for c, f in zip(committed_times["cut"], committed_times["fence"] or [0.0] * 99, strict=False)]
            )
            if committed_times["cut"]
            else None
        )
        if committed_times["committed"]:
            result.cut_to_committed_s = statistics.median(committed_times["committed"])
    elif ours is not None and ours.checkpointer is not None:
        records = [r for r in ours.checkpointer.records if r.outcome == "committed"]
        if records:
            result.bytes = records[-1].bytes
            result.reported_blocking_s = statistics.median(r.blocked_s + sum(r.fence_wait_s.values()) for r in records)
            result.cut_to_committed_s = statistics.median(r.cut_to_committed_s for r in records)
            result.persist_mbps = statistics.median(r.bytes / r.upload_s / 1e6 for r in records if r.upload_s)
            result.peak_retained_mb = max(r.peak_retained_bytes for r in records) / 1e6
    if mode == "model_checkpoint" and result.blocking_median_s:
        result.cut_to_committed_s = result.blocking_median_s
        if result.bytes:
            result.persist_mbps = result.bytes / result.blocking_median_s / 1e6
    result.note = f"fit {fit_s:.1f}s"
    del trainer, model
    gc.collect()
    return result


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
        "| mode | median step s | mean step s | overhead vs none % | overhead vs own steps % | blocking/ckpt median s |"
        " max s | reported blocking s | cut→committed s | MB | peak RSS MB | peak retained MB | persist MB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {f(r.median_step_s)} | {f(r.mean_step_s)} | {f(r.overhead_pct, 1, '{:.1f}')} | "
            f"{f(r.own_overhead_pct, 1, '{:.1f}')} | {f(r.blocking_median_s)} | "
            f"{f(r.blocking_max_s)} | {f(r.reported_blocking_s, 1, '{:.4f}')} | {f(r.cut_to_committed_s)} | "
            f"{f(r.bytes, 1e-6, '{:.0f}')} | {r.peak_rss_mb:.0f} | {f(r.peak_retained_mb, 1, '{:.0f}')} | "
            f"{f(r.persist_mbps, 1, '{:.0f}')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a markdown table and writes a JSON file. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="lightning-async-ckpt bench", description=__doc__.splitlines()[0])
    parser.add_argument("--param-mb", type=float, default=333.0, help="fp32 parameter MB (Adam adds 2x)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=95)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--upload-nice", type=int, default=0, help="nice value of our upload thread (0-19)")
    parser.add_argument("--max-outstanding", type=int, default=1, help="our saves in flight at once")
    parser.add_argument("--json", default="bench-results.json")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
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
        for mode in order:
            r = _run_mode(mode, args, folder, model_cls, state0)
            shutil.rmtree(os.path.join(folder, mode), ignore_errors=True)
            results.append(r)
            print(f"# {mode}: median step {r.median_step_s:.3f}s, blocking {r.blocking_median_s}, {r.note}", flush=True)
        end = _floors(nbytes, folder, "cpu")
        floors["raw_write_fsync_mbps_end"] = end["raw_write_fsync_mbps"]
        if "raw_direct_fsync_mbps" in end:
            floors["raw_direct_fsync_mbps_end"] = end["raw_direct_fsync_mbps"]
        # Overhead: mean step time over every step (checkpoint steps included) against no checkpointing, and
        # against the same run's steps away from checkpoints (the checkpoint's own cost, free of drift).
        baselines = [r.mean_step_s for r in results if r.mode == "none"]
        base = statistics.fmean(baselines) if baselines else None
        for r in results:
            if base and r.mode != "none":
                r.overhead_pct = 100.0 * (r.mean_step_s - base) / base
            if r.mode != "none" and r.median_step_s:
                r.own_overhead_pct = 100.0 * (r.mean_step_s - r.median_step_s) / r.median_step_s
        table = _markdown(results, floors, machine, args)
        print(table)
        payload = {"machine": machine, "args": vars(args), "floors": floors, "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(table + "\n")
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
