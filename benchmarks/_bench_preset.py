"""``bench --preset lightning-cpu``: the CPU comparison of the performance issue, interleaved and repeated in one run.

Model: 4 x ``Linear(4096)`` + Adam (about 800 MB of state), a checkpoint every 4 of 20 steps. Modes, run in turn
and repeated (``--repeats``, default 3) in one process so drift and one preemption cannot decide the verdict: no
checkpointing, ``ModelCheckpoint``, ``ModelCheckpoint`` + ``AsyncCheckpointIO``, and ``AsyncCheckpointCallback``
with its defaults. Per mode and repeat:

* **hooks s/ckpt**: seconds spent inside the checkpoint callbacks' per-step hooks (``on_train_batch_start``,
  ``on_before_optimizer_step``, ``on_train_batch_end``, epoch and validation ends; the final drain is not in it),
  per checkpoint: what a library usually reports as its blocking;
* **step slowdown s/ckpt**: what the steps felt: the steps from each cut until the next one, against the same
  repeat's median step without checkpointing (the background copy, checksum and write compete for the cores);
* **wall overhead s**: the fit's wall time minus the same repeat's run without checkpointing;
* **reported slowdown s/ckpt**: this library's own ``step_slowdown_s`` (median over its saves), for comparison.

Medians over repeats with their spread (min-max) are printed, then the ratios to ``AsyncCheckpointIO`` last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PRESETS", "run_preset"]

PRESETS: dict[str, dict[str, Any]] = {
    "lightning-cpu": {
        "param_mb": 4 * (4096 * 4096 + 4096) * 4 / 1e6,
        "width": 4096,
        "batch": 8,
        "steps": 20,
        "every": 4,
        "modes": ["none", "model_checkpoint", "async_checkpoint_io", "ours"],
    },
}
_HOOKS = (
    "on_train_batch_start",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_end",
)
_REFERENCE = "async_checkpoint_io"


def _timed_hooks(setup_fn: Callable[[Any], Any], spent: list[float]) -> Callable[[Any], Any]:
    """A mode setup whose checkpoint callbacks add the time spent in their per-step hooks to ``spent``."""

    def setup(ctx: Any) -> Any:
        mode_setup = setup_fn(ctx)
        for callback in mode_setup.callbacks:
            for name in _HOOKS:
                hook = getattr(callback, name)

                def timed(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return _hook(*args, **kwargs)
                    finally:
                        spent.append(time.perf_counter() - t0)

                setattr(callback, name, timed)
        return mode_setup

    return setup


def _ours_defaults(modes: Any) -> Callable[[Any], Any]:
    """``AsyncCheckpointCallback`` with its defaults (deferral, exact guard), no final save (as the other modes)."""

    def setup(ctx: Any) -> Any:
        from lightning_async_ckpt.lightning import AsyncCheckpointCallback

        ours = AsyncCheckpointCallback(
            dirpath=ctx.target, every_n_train_steps=ctx.args.every, save_on_train_end=False, host_memory_budget=None
        )

        def finish(result: Any, sizes: list[int]) -> None:
            records = [r for r in ours.checkpointer.records if r.outcome == "committed"] if ours.checkpointer else []
            slowdowns = [r.step_slowdown_s for r in records if r.step_slowdown_s is not None]
            result.reported_blocking_s = statistics.median(slowdowns) if slowdowns else None

        return modes.ModeSetup(callbacks=[ours], checkpointing=True, finish=finish)

    return setup


def _slowdowns(times: list[float], every: int, steps: int, quiet_median: float) -> list[float]:
    """Per cut: the steps from the cut until the next cut, minus as many quiet median steps."""
    out = []
    for cut in range(every, steps + 1, every):
        window = [times[i] for i in range(cut - 2, cut - 2 + every) if 0 <= i < len(times)]
        if window:
            out.append(sum(window) - len(window) * quiet_median)
    return out


def _fmt(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def run_preset(bench: Any, args: argparse.Namespace, defaults: dict[str, Any]) -> int:
    """Run ``args.preset`` with ``bench``'s mode runner; prints the table and the ratios. Returns the exit code.

    The preset sets the model and schedule; a flag given explicitly (not at its default in ``defaults``) wins, so a
    smaller run of the same comparison is ``--preset lightning-cpu --param-mb 8 --width 256``.
    """
    preset = PRESETS[args.preset]
    for key in ("param_mb", "width", "batch", "steps", "every"):
        if getattr(args, key) == defaults.get(key):
            setattr(args, key, preset[key])
    modes = bench._modes
    folder = args.dir or tempfile.mkdtemp(prefix="lac-bench-preset-")
    os.makedirs(folder, exist_ok=True)
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in preset["modes"]}
    saved = dict(modes.MODE_SETUPS)
    try:
        model_cls, layers = bench._build(args)
        state0 = {k: v.clone() for k, v in model_cls().state_dict().items()}
        nbytes = sum(v.numel() * v.element_size() for v in state0.values()) * 3
        floors = bench._floors(nbytes, folder, "cpu")
        print(f"# preset {args.preset}: {layers} layers, {nbytes / 1e6:.0f} MB per checkpoint; floors {floors}")
        for repeat in range(args.repeats):
            results = {}
            for mode in preset["modes"]:
                spent: list[float] = []
                base = _ours_defaults(modes) if mode == "ours" else saved[mode]
                modes.MODE_SETUPS[mode] = _timed_hooks(base, spent)
                result = bench._run_mode(mode, args, folder, model_cls, state0)
                shutil.rmtree(os.path.join(folder, mode), ignore_errors=True)
                results[mode] = (result, sum(spent))
                print(f"# repeat {repeat + 1} {mode}: fit {result.fit_s:.2f}s, hooks {sum(spent):.3f}s", flush=True)
            none = results["none"][0]
            quiet = statistics.median(none.step_times)
            cuts = len(range(args.every, args.steps + 1, args.every))
            for mode, (result, hooks) in results.items():
                f = figures[mode]
                f.setdefault("hooks s/ckpt", []).append(hooks / cuts)
                f.setdefault("step slowdown s/ckpt", []).append(
                    statistics.median(_slowdowns(result.step_times, args.every, args.steps, quiet))
                )
                f.setdefault("wall overhead s", []).append(result.fit_s - none.fit_s)
                if result.reported_blocking_s is not None and mode == "ours":
                    f.setdefault("reported slowdown s/ckpt", []).append(result.reported_blocking_s)
    finally:
        modes.MODE_SETUPS.clear()
        modes.MODE_SETUPS.update(saved)
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    columns = ["hooks s/ckpt", "step slowdown s/ckpt", "wall overhead s", "reported slowdown s/ckpt"]
    print(f"\n| mode ({args.repeats} repeats: median (min-max)) | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for mode, f in figures.items():
        print(f"| {mode} | " + " | ".join(_fmt(f.get(c, [])) for c in columns) + " |")
    ref = figures.get(_REFERENCE, {})
    print(f"\nRatios of ours to {_REFERENCE} (medians; per repeat in brackets):")
    for column in columns[:3]:
        ours, theirs = figures["ours"].get(column, []), ref.get(column, [])
        if ours and theirs and statistics.median(theirs) > 0:
            per = ", ".join(f"{a / b:.2f}" if b > 0 else "–" for a, b in zip(ours, theirs, strict=False))
            print(f"- {column}: {statistics.median(ours) / statistics.median(theirs):.3f}x [{per}]")
    return 0
