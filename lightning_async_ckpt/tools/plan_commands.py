"""The model and measurement commands of the command line: ``plan``, ``timeline`` and ``bench``.

``plan`` evaluates the backlog model (:mod:`lightning_async_ckpt.tools.planner`), ``timeline`` plots an event log
(:mod:`lightning_async_ckpt.tools.timeline`), and ``bench`` hands its arguments to ``benchmarks/bench.py`` in
the source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from typing import Any

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.fmt import fmt_bytes, fmt_seconds
from lightning_async_ckpt.tools.store_commands import UsageError

__all__ = [
    "BENCH_MODULE",
    "cmd_plan",
    "cmd_timeline",
    "exit_code",
    "format_plan",
    "load_bench",
    "parse_size",
    "run_bench",
]

# The name the benchmark module is registered under in sys.modules (tests put a stand-in there).
BENCH_MODULE = "lightning_async_ckpt_bench"
_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?i?b?)?\s*(/s)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_p}b"] = _SIZE_UNITS[_p] = 1000**_i
    _SIZE_UNITS[f"{_p}ib"] = _SIZE_UNITS[f"{_p}i"] = 1024**_i


def cmd_plan(args: argparse.Namespace) -> int:
    """``plan``: the backlog model from rates, from bytes/interval/bandwidth, or from a measured event log."""
    from lightning_async_ckpt.tools.planner import plan_from_bytes, plan_from_events, plan_from_rates, read_events

    rate_mode = args.arrival_rate is not None or args.drain_rate is not None
    byte_mode = any(v is not None for v in (args.bytes, args.interval, args.bandwidth))
    event_mode = args.events is not None
    if rate_mode + byte_mode + event_mode != 1:
        raise UsageError(
            "give exactly one of: --arrival-rate L --drain-rate M | --bytes B --interval S --bandwidth W | "
            "--events FILE.jsonl"
        )
    if rate_mode:
        _require(args, ("arrival_rate", "drain_rate"))
        plan = plan_from_rates(args.arrival_rate, args.drain_rate, args.backlog, horizon=args.horizon)
    elif byte_mode:
        _require(args, ("bytes", "interval", "bandwidth"))
        plan = plan_from_bytes(args.bytes, args.interval, args.bandwidth, args.backlog, horizon=args.horizon)
    else:
        if args.backlog:
            raise UsageError("--backlog is measured from the log with --events; drop it")
        plan = plan_from_events(read_events(args.events), horizon=args.horizon)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    print(format_plan(plan))
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    """``timeline``: plot an event log to a PNG."""
    from lightning_async_ckpt.tools.timeline import plot_timeline

    out = plot_timeline(args.events, args.output)
    print(f"wrote {out}")
    return 0


def run_bench(argv: list[str]) -> int:
    """``bench``: run ``benchmarks/bench.py``'s ``main`` with the untouched remaining arguments."""
    try:
        result = load_bench().main(argv)
    except SystemExit as exc:  # its own argparse: --help, or a usage error it already printed
        return exit_code(exc)
    return int(result or 0)


def load_bench() -> Any:
    """The benchmark module: it lives beside the other benchmarks in the source checkout (``benchmarks/bench.py``).

    Raises:
        ConfigError: Not a source checkout (an installed wheel has no ``benchmarks/``).
    """
    if BENCH_MODULE in sys.modules:
        return sys.modules[BENCH_MODULE]
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "bench.py")
    if not os.path.isfile(path):
        raise ConfigError(
            "bench ships with the source checkout (benchmarks/bench.py): run it from a clone of the repository"
        )
    spec = importlib.util.spec_from_file_location(BENCH_MODULE, os.path.normpath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[BENCH_MODULE] = module
    spec.loader.exec_module(module)
    return module


def exit_code(exc: SystemExit) -> int:
    """The exit status an argparse ``SystemExit`` carries (its message is already printed)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 2


def parse_size(text: str) -> float:
    """Parse ``4GiB``, ``500MB``, ``200MB/s``, ``1e9``; argparse turns the error into a usage error."""
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1000000, 512MB, 4GiB, 200MB/s)")
    return float(match.group(1)) * _SIZE_UNITS[unit]


def _require(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        needs = " ".join(f"--{n.replace('_', '-')}" for n in names)
        raise UsageError(f"missing {' '.join(missing)} (this mode needs {needs})")


def format_plan(plan: Any) -> str:
    """The plan as the aligned text block ``plan`` prints (``--json`` prints ``plan.to_dict()`` instead)."""
    in_bytes = plan.units == "bytes"

    def amount(v: float) -> str:
        return fmt_bytes(v) if in_bytes else f"{v:.6g} units"

    def rate(v: float) -> str:
        return f"{fmt_bytes(v)}/s" if in_bytes else f"{v:.6g} units/s"

    lines = [f"backlog model (fluid queue), from {plan.source}:"]
    if plan.bytes_per_checkpoint is not None and plan.interval_s is not None:
        lines.append(f"  checkpoint size (B)            {fmt_bytes(plan.bytes_per_checkpoint)}")
        lines.append(f"  interval (S)                   {fmt_seconds(plan.interval_s)}")
    lines += [
        f"  arrival rate (lambda)          {rate(plan.arrival_rate)}",
        f"  drain rate (mu)                {rate(plan.drain_rate)}",
        f"  backlog now (q0)               {amount(plan.backlog)}",
        f"  net rate (lambda - mu)         {rate(plan.net_rate)}"
        + ("  (drains)" if plan.net_rate < 0 else "  (grows)" if plan.net_rate > 0 else "  (steady)"),
        "  drain time                     " + _fmt_drain(plan),
        "  utilization (lambda / mu)      "
        + ("inf (nothing drains)" if plan.utilization is None else f"{plan.utilization:.3g}"),
        f"  sustainable                    {'yes' if plan.sustainable else 'no'}",
        "  smallest sustainable interval  "
        + (fmt_seconds(plan.min_interval_s) if plan.min_interval_s is not None else "n/a (needs bytes per checkpoint)"),
    ]
    if plan.recommended_interval_s is not None:
        lines.append(f"  interval with headroom         {fmt_seconds(plan.recommended_interval_s)}")
    lines.append(f"  training stalled under 'wait'  {100 * plan.stall_fraction_if_wait:.1f}%")
    if plan.horizon_s is not None:
        lines.append(f"  backlog after {fmt_seconds(plan.horizon_s):<16} {amount(plan.backlog_at_horizon)}")
    lines.append(f"  recommended admission          {plan.admission} (max_outstanding={plan.max_outstanding})")
    if plan.measured:
        m = plan.measured
        lines.append(
            f"measured: {m['requests']} requests over {fmt_seconds(m['span_s'])}, training blocked "
            f"{fmt_seconds(m['blocked_s_total'])} ({100 * m['blocked_fraction']:.1f}%), outcomes {m['outcomes']}"
        )
    lines += [f"- {note}" for note in plan.notes]
    lines.append(
        "(a rate model only: no copies, sizes, failures or futures; it certifies no schedule or memory budget)"
    )
    return "\n".join(lines)


def _fmt_drain(plan: Any) -> str:
    if plan.drain_time is None:
        return "never" + (" (balanced rates hold the backlog)" if plan.net_rate == 0 else "")
    if plan.backlog == 0:
        return "0 s (nothing outstanding)"
    return fmt_seconds(plan.drain_time)
