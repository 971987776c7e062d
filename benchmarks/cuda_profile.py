"""Where a cut's cost goes on a GPU, seen from outside: CUDA-event step times, host step times, and a profile.

For each mode (no checkpointing, copy at cut, fenced) it trains the bench's model with Lightning and records, at
every ``on_train_batch_start``, the host clock and a CUDA event on the compute stream. The GPU's step times (event
to event) show what the checkpoint costs the device; the host's show what it costs the training thread. Then it
profiles the steps around the first cut of the fenced mode with ``torch.profiler`` and prints the top operations.

Usage: python benchmarks/cuda_profile.py --out DIR [--param-mb 1000 --width 8192 --batch 4096 --steps 70 --every 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_async_ckpt.lightning import AsyncCheckpointCallback


def _model(width: int, layers: int) -> pl.LightningModule:
    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    return Model()


class _Clock(pl.Callback):
    lightning_async_ckpt_read_only = True

    def __init__(self, profile_steps: set[int], out: str) -> None:
        self.host: list[float] = []
        self.events: list[torch.cuda.Event] = []
        self.profile_steps = profile_steps
        self.out = out
        self.prof = None
        self.d2h: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.host.append(time.perf_counter())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.events.append(ev)
        step = trainer.global_step
        if self.profile_steps and step == min(self.profile_steps) and self.prof is None:
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            self.prof.__enter__()
        if self.prof is not None and step == max(self.profile_steps) + 1:
            self._stop()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        for key in ("cpu_time_total", "self_cpu_time_total", "cuda_time_total"):
            try:
                print(f"== profile sorted by {key}")
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
            except Exception as exc:  # noqa: BLE001 - key names differ across torch versions
                print(f"(no table by {key}: {exc})")
        copies = [e for e in prof.key_averages() if "Memcpy DtoH" in e.key]
        device_us = sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) for e in copies)
        self.d2h = {"copies": sum(e.count for e in copies), "device_ms": device_us / 1e3}
        print(f"== device-to-host copies in the profiled window: {self.d2h}", flush=True)
        try:
            prof.export_chrome_trace(os.path.join(self.out, "trace.json"))
        except Exception as exc:  # noqa: BLE001
            print(f"(no trace: {exc})")

    def on_train_end(self, trainer, pl_module):
        self.host.append(time.perf_counter())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.events.append(ev)
        if self.prof is not None:
            self._stop()


def run(mode: str, args: argparse.Namespace, layers: int, state0: dict, profile: bool) -> dict:
    folder = tempfile.mkdtemp(prefix=f"prof-{mode}-", dir=args.tmp)
    model = _model(args.width, layers)
    model.load_state_dict(state0)
    cuts = list(range(args.every, args.steps + 1, args.every))
    # The first cut (it pays for anything done once); the profiler starts two steps early (its own start-up).
    clock = _Clock(set(range(cuts[0] - 2, cuts[0] + 2)) if profile else set(), args.out)
    callbacks: list = [clock]
    ours = None
    if mode != "none":
        ours = AsyncCheckpointCallback(
            dirpath=folder,
            every_n_train_steps=args.every,
            defer=mode == "defer",
            save_on_train_end=False,
            host_memory_budget=None,
        )
        callbacks.append(ours)
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * 4, args.width))
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=mode != "none",
        num_sanity_val_steps=0,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    torch.cuda.synchronize()
    host = [b - a for a, b in zip(clock.host, clock.host[1:], strict=False)]
    gpu = [a.elapsed_time(b) / 1e3 for a, b in zip(clock.events, clock.events[1:], strict=False)]
    # index i is the step that ends at global step i + 1; the cut at step s is taken at the end of index s - 1.
    near = {i for s in cuts for i in (s - 1, s)}
    clean_h = statistics.median([t for i, t in enumerate(host[1:], 1) if i not in near])
    clean_g = statistics.median([t for i, t in enumerate(gpu[1:], 1) if i not in near])
    out = {
        "mode": mode,
        "host_median": clean_h,
        "gpu_median": clean_g,
        "host_mean": statistics.fmean(host[1:]),
        "gpu_mean": statistics.fmean(gpu[1:]),
        "around_cuts_host": [[round(host[i], 4) for i in range(s - 2, min(s + 2, len(host)))] for s in cuts],
        "around_cuts_gpu": [[round(gpu[i], 4) for i in range(s - 2, min(s + 2, len(gpu)))] for s in cuts],
        "extra_host_per_cut": [round(host[s - 1] + host[s] - 2 * clean_h, 4) for s in cuts if s < len(host)],
        "extra_gpu_per_cut": [round(gpu[s - 1] + gpu[s] - 2 * clean_g, 4) for s in cuts if s < len(gpu)],
    }
    if ours is not None and ours.checkpointer is not None:
        recs = ours.checkpointer.records
        out["records"] = [
            {
                "step": r.requested_step,
                "outcome": str(r.outcome),
                "blocked_s": r.blocked_s,
                "fence_wait_s": dict(r.fence_wait_s),
                "upload_s": r.upload_s,
                "bytes": r.bytes,
                "staging_s": r.staging_s,
                "cut_to_committed_s": r.cut_to_committed_s,
            }
            for r in recs
        ]
        if clock.d2h and recs and clock.d2h["device_ms"] > 0:
            staged = recs[0].sync_bytes + recs[0].deferred_bytes
            out["first_cut_d2h"] = dict(clock.d2h, bytes=staged, gbps=staged / clock.d2h["device_ms"] / 1e6)
        out["pool_allocations_at_cut"] = ours.checkpointer.pool.allocations_at_cut
        out["pool_bytes_allocated_at_cut"] = ours.checkpointer.pool.bytes_allocated_at_cut
    print(json.dumps(out, default=str), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for profile.json and trace.json")
    parser.add_argument("--tmp", default=None, help="folder for the checkpoints (default: the system temp dir)")
    parser.add_argument("--param-mb", type=float, default=1000, help="fp32 parameter megabytes of the model")
    parser.add_argument("--width", type=int, default=8192, help="width of each Linear layer")
    parser.add_argument("--batch", type=int, default=4096, help="batch size")
    parser.add_argument("--steps", type=int, default=70, help="training steps per mode")
    parser.add_argument("--every", type=int, default=30, help="a checkpoint every this many steps")
    parser.add_argument("--modes", default="none,defer", help="comma-separated: none, copy, defer")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    layers = max(1, int(args.param_mb * 1e6 / 4 / (args.width * args.width + args.width)))
    state0 = _model(args.width, layers).state_dict()
    results = [run(m, args, layers, state0, profile=False) for m in args.modes.split(",")]
    results.append(run("defer", args, layers, state0, profile=True) | {"mode": "defer (profiled)"})
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
