"""Restart time after a kill, per tier, on a GPU: process start to the end of the first training step.

One run of the bench's model (``--param-mb`` of fp32 ``Linear(width, width)`` layers + Adam: 2.4 GB per checkpoint at
the defaults) trains on CUDA with two tiers (``local_dirpath`` on the disk or on ``/dev/shm``, ``dirpath`` a second
folder) until a generation is committed in both tiers; then the process ends as a killed one would (``os._exit``,
no teardown). Each restart is a fresh process (``python gpu_restart.py --worker resume ...``) timed from the
parent's ``Popen`` to the end of its first training step, with the callback's ``ckpt_path="last"`` lookup:

* ``local-disk`` / ``local-shm``: the callback has ``local_dirpath`` (the local tier is read);
* ``durable-only``: no ``local_dirpath`` (a new node: only ``dirpath`` is read).

The page cache is dropped before each restart when the machine lets us (``/proc/sys/vm/drop_caches``, root); the
table says whether it did. Restarts are interleaved ``--repeats`` times. Prints a markdown table; ``--json`` keeps
every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

T0 = time.time()


def _model_cls(width: int, layers: int):
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class RestartModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
            self.marks: dict[str, float] = {}

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def setup(self, stage: str) -> None:
            self.marks.setdefault("setup", time.time())  # after the checkpoint lookup, before the restore

        def on_fit_start(self) -> None:
            self.marks.setdefault("fit_start", time.time())  # weights restored, model on the device

        def on_train_start(self) -> None:
            self.marks.setdefault("train_start", time.time())

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.setdefault("first_step_end", time.time())

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    return RestartModel


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_async_ckpt import AsyncCheckpointCallback

    marks = {"imported": time.time()}
    layers = max(1, int(args.param_mb * 1e6 / 4 / (args.width * args.width + args.width)))
    torch.manual_seed(0)
    model = _model_cls(args.width, layers)()
    marks["model_built"] = time.time()
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * 2, args.width))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    train = args.worker == "train"
    callback = AsyncCheckpointCallback(
        dirpath=args.durable,
        local_dirpath=args.local or None,
        every_n_train_steps=args.steps if train else 10**6,
        local_every_n_train_steps=(args.steps // 2 if train else 10**6) if args.local else None,
        save_on_train_end=train,
        host_memory_budget=None,
    )
    trainer = pl.Trainer(
        accelerator=args.device,
        devices=1,
        max_steps=args.steps if train else args.steps + 1,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader, ckpt_path=None if train else "last")
    marks.update(model.marks)
    marks["resumed_step"] = trainer.global_step - 1 if not train else trainer.global_step
    print("RESULT " + json.dumps(marks), flush=True)
    sys.stdout.flush()
    os._exit(0)  # as a killed process: no teardown after the commit


def _drop_caches() -> bool:
    """Drop the page cache (the checkpoint's files are read from the device), then warm the imports again: a process
    killed on a living node finds its libraries cached; only the checkpoint must come from its tier."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    warm = "import torch, lightning.pytorch, lightning_async_ckpt; torch.zeros(1).cuda() if torch.cuda.is_available() else None"
    subprocess.run([sys.executable, "-c", warm], check=True)
    return True


def _run(args: argparse.Namespace, role: str, durable: str, local: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", role, "--durable", durable, "--local", local]
    cmd += ["--param-mb", str(args.param_mb), "--width", str(args.width), "--batch", str(args.batch)]
    cmd += ["--steps", str(args.steps), "--device", args.device]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise RuntimeError(f"{role} worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    marks = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    return {k: (v - start if k != "resumed_step" else v) for k, v in marks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("train", "resume"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--durable", default="")
    parser.add_argument("--local", default="")
    parser.add_argument("--root", default="/tmp/lac-restart", help="folder for the disk tiers")
    parser.add_argument("--shm", default="/dev/shm/lac-restart", help="local tier in RAM ('' to skip)")
    parser.add_argument("--param-mb", type=float, default=1000.0)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20, help="steps of the first run (local cut at half)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: to try the script")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    for folder in (args.root, args.shm):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    setups = {"local-disk": (f"{args.root}/durable-disk", f"{args.root}/local")}
    if args.shm:
        setups["local-shm"] = (f"{args.root}/durable-shm", args.shm)
    trained = {}
    for name, (durable, local) in setups.items():
        trained[name] = _run(args, "train", durable, local)
        print(f"# trained with {name}: {trained[name]}", flush=True)
    scenarios = {name: (durable, local) for name, (durable, local) in setups.items()}
    scenarios["durable-only"] = (setups["local-disk"][0], "")
    results: dict[str, list[dict]] = {name: [] for name in scenarios}
    dropped = []
    for _ in range(args.repeats):
        for name, (durable, local) in scenarios.items():
            dropped.append(_drop_caches())
            marks = _run(args, "resume", durable, local)
            results[name].append(marks)
            print(f"# {name}: {marks}", flush=True)
    print(
        f"\nPage cache dropped before each restart (imports warmed again): {all(dropped)}. "
        "Restart = Popen to the end of the first step.\n"
    )
    print(
        "| restart from | first step done s (median) | runs | imports s | model built s | lookup done (setup) s |"
        " weights restored (fit start) s | optimizer restored (train start) s | step |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("first_step_end", "imported", "model_built")}
        more = [statistics.median(r.get(k, float("nan")) for r in runs) for k in ("setup", "fit_start", "train_start")]
        all_runs = ", ".join(f"{r['first_step_end']:.1f}" for r in runs)
        print(
            f"| {name} | {med['first_step_end']:.2f} | {all_runs} | {med['imported']:.2f} | "
            f"{med['model_built']:.2f} | " + " | ".join(f"{v:.2f}" for v in more) + f" | {runs[0]['resumed_step']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trained": trained, "restarts": results, "page_cache_dropped": all(dropped)}, f, indent=1)
    for folder in (args.root, args.shm):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
