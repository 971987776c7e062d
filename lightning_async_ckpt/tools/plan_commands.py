"""The model and measurement commands of the command line: ``plan``, ``timeline`` and ``bench``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict
from typing import Any

from lightning_async_ckpt.core.units import parse_size as size_in_bytes
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.fmt import fmt_bytes, fmt_seconds, print_table
from lightning_async_ckpt.tools.store_commands import UsageError

__all__ = [
    "BENCH_MODULE",
    "cmd_plan",
    "cmd_timeline",
    "exit_code",
    "format_plan",
    "load_bench",
    "parse_duration",
    "parse_size",
    "run_bench",
]

# The name the benchmark module is registered under in sys.modules (tests put a stand-in there).
BENCH_MODULE = "lightning_async_ckpt_bench"
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(us|ms|s|min|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0, "h": 3600.0}
# The flags of each plan model beside the backlog model's (their dests, as argparse names them).
_REQUEST_FLAGS = ("ranks", "generations", "keep_last", "request_latency", "put_rate", "get_rate")
_RECOVERY_FLAGS = (
    "state_bytes",
    "local_bandwidth",
    "durable_bandwidth",
    "local_every",
    "durable_every",
    "preempt_every",
    "startup",
    "node_loss",
    "blocking",
)


def cmd_plan(args: argparse.Namespace) -> int:
    """``plan``: the backlog model (rates, bytes/interval/bandwidth, or an event log), the request model, or the
    recovery model."""
    from lightning_async_ckpt.tools.planner import plan_from_bytes, plan_from_events, plan_from_rates, read_events

    rate_mode = args.arrival_rate is not None or args.drain_rate is not None
    byte_mode = any(v is not None for v in (args.bytes, args.interval, args.bandwidth))
    event_mode = args.events is not None
    request_mode = any(getattr(args, n, None) is not None for n in _REQUEST_FLAGS)
    recovery_mode = any(getattr(args, n, None) is not None for n in _RECOVERY_FLAGS)
    if rate_mode + byte_mode + event_mode + request_mode + recovery_mode != 1:
        raise UsageError(
            "give exactly one of: --arrival-rate L --drain-rate M | --bytes B --interval S --bandwidth W | "
            "--events FILE.jsonl | --ranks N --generations G (requests) | --state-bytes B ... (recovery)"
        )
    if (request_mode or recovery_mode) and (args.backlog or args.horizon is not None):
        raise UsageError("--backlog and --horizon belong to the backlog model; drop them")
    if request_mode:
        return _plan_requests(args)
    if recovery_mode:
        return _plan_recovery(args)
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
    try:
        return size_in_bytes(re.sub(r"\s*/s\s*$", "", text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1000000, 512MB, 4GiB, 200MB/s)") from None


def parse_duration(text: str) -> float:
    """Parse ``15ms``, ``0.015``, ``2s``, ``5min``, ``1h`` into seconds; argparse turns the error into a usage error."""
    match = _DURATION_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (examples: 15ms, 0.015, 2s, 5min, 1h)")
    return float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]


def _plan_requests(args: argparse.Namespace) -> int:
    """``plan --ranks N --generations G``: requests and time per save and per resume (the request model)."""
    from lightning_async_ckpt.tools.request_model import predict_resume, predict_save, predict_sharded_save

    _require(args, ("generations",))
    ranks = 1 if args.ranks is None else args.ranks
    if ranks < 1 or args.generations < 0 or (args.keep_last is not None and args.keep_last < 1):
        raise UsageError("need --ranks >= 1, --generations >= 0 and --keep-last >= 1")
    keep_last = 2 if args.keep_last is None else args.keep_last
    limits = {
        "latency_s": 0.015 if args.request_latency is None else args.request_latency,
        "put_rate": args.put_rate,
        "get_rate": args.get_rate,
    }
    gens = args.generations + 1  # the folder when retention lists it: this save's generation too
    if ranks == 1:
        save = predict_save(objects=1, generations=gens, keep_last=keep_last, **limits)
        objects = 1
    else:
        save = predict_sharded_save(ranks=ranks, generations=gens, keep_last=keep_last, **limits)
        objects = ranks + 1  # one data file per rank and DCP's .metadata
    limits.pop("put_rate")
    one = predict_resume(objects=objects, generations=args.generations, **limits)
    every = {k: v * ranks for k, v in one.requests.items()}
    every_time = one.time_s if not args.get_rate else max(one.time_s, sum(every.values()) / args.get_rate)
    body = {
        "ranks": ranks,
        "generations": args.generations,
        "keep_last": keep_last,
        "request_latency_s": limits["latency_s"],
        "put_rate": args.put_rate,
        "get_rate": args.get_rate,
        "save": save.to_dict(),
        "resume_one_rank": one.to_dict(),
        "resume_every_rank": {"requests": every, "total": sum(every.values()), "time_s": every_time},
    }
    if args.json:
        print(json.dumps(body, indent=1))
        return 0
    rates = ", ".join(
        f"{name} {rate:,.0f}/s" for name, rate in (("PUT-class", args.put_rate), ("GET-class", args.get_rate)) if rate
    )
    lines = [
        f"object-store requests (request model, docs/backlog-model.md), {ranks:,} rank(s), "
        f"{args.generations:,} generations, keep_last={keep_last}, {1e3 * limits['latency_s']:g} ms a request"
        + (f", {rates}" if rates else ", no rate limit"),
        f"  per save{' (all ranks)' if ranks > 1 else ''}:".ljust(36)
        + f"{_kinds(save.requests)}; {save.serial:,} in series; {fmt_seconds(save.time_s)} ({save.bound})",
        "  per resume, one rank:".ljust(36) + f"{_kinds(one.requests)}; {fmt_seconds(one.time_s)} ({one.bound})",
    ]
    if ranks > 1:
        lines.append(
            "  per resume, every rank finds it:".ljust(36)
            + f"{_kinds(every)}; {fmt_seconds(every_time)} (ranks in parallel)"
        )
    lines.append("(counts pinned to a moto S3 server's; times are latency x serial requests, or the rate limits)")
    print("\n".join(lines))
    return 0


def _plan_recovery(args: argparse.Namespace) -> int:
    """``plan --state-bytes B ...``: restore time, lost work and goodput for blocking, one tier and two tiers."""
    from lightning_async_ckpt.tools.recovery_model import RecoveryInputs, plan_recovery

    needed = ("state_bytes", "local_bandwidth", "durable_bandwidth", "local_every", "durable_every", "preempt_every")
    _require(args, needed)
    inputs = RecoveryInputs(
        state_bytes=args.state_bytes,
        local_bandwidth=args.local_bandwidth,
        durable_bandwidth=args.durable_bandwidth,
        local_every_s=args.local_every,
        durable_every_s=args.durable_every,
        preempt_every_s=args.preempt_every,
        startup_s=args.startup or 0.0,
        node_loss=0.0 if args.node_loss is None else args.node_loss,
        blocking_s=args.blocking or 0.0,
    )
    plans = plan_recovery(inputs)
    if args.json:
        print(json.dumps({"inputs": asdict(inputs), "plans": [p.to_dict() for p in plans]}, indent=1))
        return 0
    rows = [("", "commit latency", "restore", "lost work", "blocked", "goodput")]
    rows += [
        (
            p.name,
            fmt_seconds(p.commit_latency_s),
            fmt_seconds(p.restore_s),
            fmt_seconds(p.lost_work_s),
            f"{100 * p.overhead:.1f}%",
            f"{100 * p.goodput:.1f}%",
        )
        for p in plans
    ]
    print(
        f"recovery model (docs/backlog-model.md): {fmt_bytes(inputs.state_bytes)} per checkpoint, local "
        f"{fmt_bytes(inputs.local_bandwidth)}/s every {fmt_seconds(inputs.local_every_s)}, durable "
        f"{fmt_bytes(inputs.durable_bandwidth)}/s every {fmt_seconds(inputs.durable_every_s)}, a preemption every "
        f"{fmt_seconds(inputs.preempt_every_s)} ({100 * inputs.node_loss:g}% lose the node), startup "
        f"{fmt_seconds(inputs.startup_s)}"
    )
    print_table(rows)
    print("(expected values per preemption; goodput = training time / wall time; first-order, no queueing)")
    return 0


def _kinds(requests: dict[str, int]) -> str:
    parts = ", ".join(
        f"{requests[k]:,} {k}" for k in ("LIST", "GET", "HEAD", "PUT", "POST", "DELETE") if requests.get(k)
    )
    return f"{sum(requests.values()):,} requests ({parts})"


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
