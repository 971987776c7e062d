"""``bench --preset lightning-cpu``: the CPU comparison of the performance issue, interleaved and repeated in one run.

Model: 4 x ``Linear(4096)`` + Adam (about 800 MB of state), a checkpoint every 4 of 40 steps: ten checkpoints a fit,
as real fits take, so the final one is one cost in ten. Modes, run in turn and repeated (``--repeats``, default 3)
in one process so drift and one preemption cannot decide the verdict. What each mode writes:

* ``none``: nothing (the baseline);
* ``model_checkpoint``: ``ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)``, one ``torch.save`` file at each of
  steps 4, 8, ..., 40 (the last is step 40's; no ``last.ckpt``), written on the training thread;
* ``async_checkpoint_io``: the same ten files, written by ``AsyncCheckpointIO``'s thread (its last one is waited
  for at teardown, inside ``fit``);
* ``ours``: ``AsyncCheckpointCallback`` with its defaults (deferral, exact guard, the final checkpoint copied at the
  cut: step 40's, the same step, not an extra one), keeping every generation like the others (``save_top_k=-1``):
  ten committed generations, each fsynced before its manifest.

**The wall clock of every mode stops after** ``os.sync()`` (``fit`` then the sync, the baseline included), so every
mode's checkpoints are durable when it stops: ``AsyncCheckpointIO`` and ``ModelCheckpoint`` leave their files in
the page cache, this library fsyncs before it commits. Per mode and repeat:

* **hooks s** and **hooks s/ckpt**: seconds inside the checkpoint callbacks' per-step hooks (``on_train_batch_start``,
  ``on_before_optimizer_step``, ``on_train_batch_end``, epoch and validation ends; the final drain is not in it), in
  all and per checkpoint: what a library usually reports as its blocking;
* **step slowdown s/ckpt**: what the steps felt: the steps from each cut until the next one, against the same
  repeat's median step without checkpointing (the background copy, checksum and write compete for the cores);
* **wall overhead s** and **%**: the fit's durable wall time minus the same repeat's run without checkpointing;
* **ckpt CPU s/GB**: the process's CPU seconds (every thread, OpenMP's too) minus the same repeat's baseline, per GB
  written: all the checkpoint work of the mode, and more (OpenMP's idle threads spin, so a longer fit adds CPU);
* **library CPU s/GB** (ours): CPU seconds of this library's named threads (their own thread clocks), per GB: its
  background work (staging copy, checksum, writes), the training thread's work at the cut not included (nor the
  CPU of OpenMP threads a copy of torch's may start from them: that is in **ckpt CPU** only);
* **reported slowdown s/ckpt**: this library's own ``step_slowdown_s`` (median over its saves), for comparison.

The **CPU floor per GB** is measured in the same run, once per repeat, on the training thread's clock: one memcpy,
one CRC-32C with the library's checksum function, and the write syscalls of that GB, the cheaper of a buffered
``write`` then ``fsync`` and an ``O_DIRECT`` write from page-aligned memory then ``fsync`` (how this library writes
on a local disk), both of a temporary file and both printed. So is the **hooks floor**
(``_bench_floors.py``): the final checkpoint's copy at the cut plus, for every other cut, the write tracker's arming of
the same bytes, each page written just before. Medians over repeats with their spread (min-max) are printed, then the ratios the
issue sets targets on, last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "run_preset"]

PRESETS: dict[str, dict[str, Any]] = {
    "lightning-cpu": {
        "param_mb": 4 * (4096 * 4096 + 4096) * 4 / 1e6,
        "width": 4096,
        "batch": 8,
        "steps": 40,
        "every": 4,
        "modes": ["none", "model_checkpoint", "async_checkpoint_io", "ours", "ours_huge_pages"],
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
_HOOK_FLOORS = ("final copy", "arming", "hooks floor")
_LIBRARY_THREADS = ("lightning_async_ckpt", "lightning-async-ckpt")
_TICK = os.sysconf("SC_CLK_TCK")
# (column, target of ours / AsyncCheckpointIO's) of the ratios the issue sets targets on.
_TARGETS = {"hooks s": 0.05, "wall overhead s": 0.10}
_COLUMNS = [
    "hooks s",
    "hooks s/ckpt",
    "step slowdown s/ckpt",
    "wall overhead s",
    "wall overhead %",
    "ckpt CPU s/GB",
    "library CPU s/GB",
    "reported slowdown s/ckpt",
]


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


def _ours_defaults(modes: Any, **opt_in: Any) -> Callable[[Any], Any]:
    """``AsyncCheckpointCallback`` with its defaults (final checkpoint included), keeping every generation; with
    ``opt_in`` options on top (``ours_huge_pages``: ``huge_pages=True``)."""

    def setup(ctx: Any) -> Any:
        from lightning_async_ckpt.lightning import AsyncCheckpointCallback

        ours = AsyncCheckpointCallback(
            dirpath=ctx.target, every_n_train_steps=ctx.args.every, save_top_k=-1, host_memory_budget=None, **opt_in
        )

        def finish(result: Any, sizes: list[int]) -> None:
            records = [r for r in ours.checkpointer.records if r.outcome == "committed"] if ours.checkpointer else []
            slowdowns = [r.step_slowdown_s for r in records if r.step_slowdown_s is not None]
            result.reported_blocking_s = statistics.median(slowdowns) if slowdowns else None

        return modes.ModeSetup(callbacks=[ours], checkpointing=True, finish=finish)

    return setup


def _written(folder: str) -> tuple[int, int]:
    """The checkpoint files (``*.ckpt``) under ``folder`` and the bytes of every file there."""
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    return sum(f.endswith(".ckpt") for f in files), sum(os.path.getsize(f) for f in files)


def _is_library(thread: threading.Thread) -> bool:
    return thread.name.startswith(_LIBRARY_THREADS) and "-bench-" not in thread.name


def _live_library_cpu() -> dict[int, float]:
    """CPU seconds of each live library thread so far, by native id (``/proc/self/task/<tid>/stat``)."""
    out = {}
    for thread in threading.enumerate():
        if not _is_library(thread) or thread.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[thread.native_id] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _with_cpu(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run ``fn``; return its result, the process's CPU seconds and this library's threads' CPU seconds meanwhile.

    A library thread started meanwhile is read on its own clock as it ends (``Thread.run`` wrapped for the call)
    or at the end if still alive; one alive before is read from ``/proc`` at both ends (one started before and
    ended meanwhile would be missed: each mode builds its own callback, so its threads start within the call).
    """
    ended: dict[int, float] = {}
    real_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        try:
            real_run(self)
        finally:
            if _is_library(self) and self.native_id is not None:
                ended[self.native_id] = time.thread_time()

    before, cpu0 = _live_library_cpu(), _process_cpu()
    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        out = fn()
    finally:
        threading.Thread.run = real_run  # type: ignore[method-assign]
    process = _process_cpu() - cpu0
    live = {tid: cpu for tid, cpu in _live_library_cpu().items() if tid not in ended}
    library = sum(cpu - before.get(tid, 0.0) for tid, cpu in {**ended, **live}.items())
    return out, process, library


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


def _ratio(ours: list[float], theirs: list[float]) -> str | None:
    if not ours or not theirs or statistics.median(theirs) <= 0:
        return None
    per = ", ".join(f"{a / b:.3f}" if b > 0 else "–" for a, b in zip(ours, theirs, strict=False))
    return f"{statistics.median(ours) / statistics.median(theirs):.3f}x [{per}]"


def _versions() -> str:
    import lightning
    import torch

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{now}, {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, lightning {lightning.__version__}"
    )


def _load_floors() -> Any:
    """``_bench_floors.py`` beside this file (loaded by path, like this one)."""
    spec = importlib.util.spec_from_file_location("lac_bench_floors", Path(__file__).with_name("_bench_floors.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_floors = _load_floors()


def run_preset(bench: Any, args: argparse.Namespace, defaults: dict[str, Any]) -> int:
    """Run ``args.preset`` with ``bench``'s mode runner; prints the table and the ratios. Returns the exit code.

    The preset sets the model and schedule; a flag given explicitly (not at its default in ``defaults``) wins, so a
    smaller run of the same comparison is ``--preset lightning-cpu --param-mb 8 --width 256``.
    """
    preset = PRESETS[args.preset]
    for key in ("param_mb", "width", "batch", "steps", "every"):
        if getattr(args, key) == defaults.get(key):
            setattr(args, key, preset[key])
    args.durable_wall = True  # every mode's wall time ends when its checkpoints are durable
    chosen = preset["modes"]
    if args.modes != defaults.get("modes"):  # an explicit --modes: a subset of the preset's, `none` always first
        chosen = ["none", *[m for m in preset["modes"] if m != "none" and m in args.modes.split(",")]]
    modes = bench._modes
    folder = args.dir or tempfile.mkdtemp(prefix="lac-bench-preset-")
    os.makedirs(folder, exist_ok=True)
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in chosen}
    floors: dict[str, list[float]] = {}
    saved = dict(modes.MODE_SETUPS)
    cuts = len(range(args.every, args.steps + 1, args.every))
    try:
        model_cls, layers = bench._build(args)
        state0 = {k: v.clone() for k, v in model_cls().state_dict().items()}
        nbytes = sum(v.numel() * v.element_size() for v in state0.values()) * 3
        print(f"# run: {_versions()}")
        print(
            f"# preset {args.preset}: {layers} layers, {nbytes / 1e6:.0f} MB per checkpoint, a checkpoint every "
            f"{args.every} of {args.steps} steps ({cuts} per fit); wall time ends after os.sync(); throughput "
            f"floors {bench._floors(nbytes, folder, 'cpu')}"
        )
        for repeat in range(args.repeats):
            for name, value in {**_floors.cpu_floor(nbytes, folder), **_floors.hooks_floor(nbytes, cuts)}.items():
                floors.setdefault(name, []).append(value)
            results = {}
            for mode in chosen:
                spent: list[float] = []
                if mode == "ours_huge_pages":
                    base = _ours_defaults(modes, huge_pages=True)
                else:
                    base = _ours_defaults(modes) if mode == "ours" else saved[mode]
                modes.MODE_SETUPS[mode] = _timed_hooks(base, spent)
                result, process_cpu, library_cpu = _with_cpu(
                    lambda mode=mode: bench._run_mode(mode, args, folder, model_cls, state0)
                )
                files, size = _written(os.path.join(folder, mode))
                shutil.rmtree(os.path.join(folder, mode), ignore_errors=True)
                results[mode] = (result, sum(spent), process_cpu, library_cpu, size / 1e9)
                print(
                    f"# repeat {repeat + 1} {mode}: fit {result.fit_s:.2f}s (os.sync {result.sync_s:.2f}s), hooks "
                    f"{sum(spent):.3f}s, {files} checkpoint files, {size / 1e9:.2f} GB, CPU {process_cpu:.2f}s"
                    + (f" (library threads {library_cpu:.2f}s)" if mode.startswith("ours") else ""),
                    flush=True,
                )
            none, _, none_cpu, _, _ = results["none"]
            quiet = statistics.median(none.step_times)
            for mode, (result, hooks, process_cpu, library_cpu, gb) in results.items():
                f = figures[mode]
                f.setdefault("hooks s", []).append(hooks)
                f.setdefault("hooks s/ckpt", []).append(hooks / cuts)
                f.setdefault("step slowdown s/ckpt", []).append(
                    statistics.median(_slowdowns(result.step_times, args.every, args.steps, quiet))
                )
                f.setdefault("wall overhead s", []).append(result.fit_s - none.fit_s)
                f.setdefault("wall overhead %", []).append(100 * (result.fit_s - none.fit_s) / none.fit_s)
                if gb > 0:
                    f.setdefault("ckpt CPU s/GB", []).append((process_cpu - none_cpu) / gb)
                if gb > 0 and mode.startswith("ours"):
                    f.setdefault("library CPU s/GB", []).append(library_cpu / gb)
                if result.reported_blocking_s is not None and mode.startswith("ours"):
                    f.setdefault("reported slowdown s/ckpt", []).append(result.reported_blocking_s)
    finally:
        modes.MODE_SETUPS.clear()
        modes.MODE_SETUPS.update(saved)
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    _report(args, figures, floors)
    return 0


def _report(
    args: argparse.Namespace, figures: dict[str, dict[str, list[float]]], floors: dict[str, list[float]]
) -> None:
    """The table, the CPU floor, then the ratios with the issue's targets (last)."""
    print(f"\n| mode ({args.repeats} repeats: median (min-max)) | " + " | ".join(_COLUMNS) + " |")
    print("|---" * (len(_COLUMNS) + 1) + "|")
    for mode, f in figures.items():
        print(f"| {mode} | " + " | ".join(_fmt(f.get(c, [])) for c in _COLUMNS) + " |")
    hooks = {k: floors.pop(k) for k in _HOOK_FLOORS if k in floors}
    print(
        "\nCPU floor per GB, this run (CPU s/GB, median (min-max)): "
        + ", ".join(f"{k} {_fmt(v)}" for k, v in floors.items())
    )
    if hooks:
        print(
            "Hooks floor, this run (s on the training thread, median (min-max)): "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in hooks.items())
            + " (the final checkpoint's copy at the cut plus every other cut's arming of the write tracker)"
        )
    ref = figures.get(_REFERENCE, {})
    for name in [m for m in figures if m.startswith("ours")]:
        ours = figures[name]
        print(f"\nRatios of {name} to {_REFERENCE} (medians; per repeat in brackets):")
        for column in ("hooks s", "hooks s/ckpt", "step slowdown s/ckpt", "wall overhead s"):
            ratio = _ratio(ours.get(column, []), ref.get(column, []))
            target = f" (target <= {_TARGETS[column]:.2f}x)" if column in _TARGETS else ""
            if ratio is not None or target:
                print(f"- {column}: {ratio or f'– ({_REFERENCE} at or below 0 in this run)'}{target}")
        if "hooks floor" in hooks:
            print(f"- hooks s of {name} to the hooks floor: {_ratio(ours.get('hooks s', []), hooks['hooks floor'])}")
            floor_ratio = _ratio(hooks["hooks floor"], ref.get("hooks s", []))
            print(f"- the hooks floor to {_REFERENCE}'s hooks s: {floor_ratio}")
        for column, target in (("library CPU s/GB", " (target <= 1.30x)"), ("ckpt CPU s/GB", "")):
            ratio = _ratio(ours.get(column, []), floors.get("floor", []))
            if ratio is not None:
                print(f"- {column} of {name} to the CPU floor: {ratio}{target}")
    ours = figures.get("ours", {})
    print(f"\nFor docs/benchmarks.md (medians of {args.repeats} repeats; spread in the table):")
    print(f"- {_med(ours, 'hooks s')} s in the per-step hooks against {_REFERENCE}'s {_med(ref, 'hooks s')} s")
    others = ", ".join(f"{m} {_med(f, 'wall overhead %', '{:.1f}')}%" for m, f in figures.items() if m != "none")
    print(f"- durable wall overhead against no checkpointing: {others}")
    print(
        f"- background CPU of ours: {_med(ours, 'library CPU s/GB')} s/GB in its threads, "
        f"{_med(ours, 'ckpt CPU s/GB')} s/GB in all; floor {_med(floors, 'floor')} s/GB "
        f"({', '.join(f'{k} {_med(floors, k)}' for k in floors if k != 'floor')})"
    )


def _med(figures: dict[str, list[float]], column: str, fmt: str = "{:.3f}") -> str:
    values = figures.get(column, [])
    return fmt.format(statistics.median(values)) if values else "–"
