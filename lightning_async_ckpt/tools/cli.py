"""The ``lightning-async-ckpt`` command line: list, verify and garbage-collect a store, plan, plot, bench.

Every command exits 0 on success, 1 when ``verify`` finds a damaged generation, and 2 on bad input (unknown URI
scheme, missing generation, malformed event log, negative rates), with a one-line message on stderr and no
traceback. ``--debug`` before the command shows the traceback of an unexpected error.

Examples::

    lightning-async-ckpt ls runs/demo
    lightning-async-ckpt verify s3://bucket/run --storage-option endpoint_url=http://127.0.0.1:9000
    lightning-async-ckpt gc runs/demo --keep-last 3 --dry-run
    lightning-async-ckpt plan --bytes 10GiB --interval 300 --bandwidth 200MB/s
    lightning-async-ckpt timeline runs/demo/events.jsonl -o timeline.png
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning_async_ckpt.errors import CheckpointError, ConfigError

__all__ = ["main"]

PROG = "lightning-async-ckpt"
_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?i?b?)?\s*(/s)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_p}b"] = _SIZE_UNITS[_p] = 1000**_i
    _SIZE_UNITS[f"{_p}ib"] = _SIZE_UNITS[f"{_p}i"] = 1024**_i


class _UsageError(Exception):
    """Bad input found after parsing; exit 2 with the message."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage block is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status: 0 success, 1 verification failed, 2 bad input.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list[:1]
    if debug:
        args_list = args_list[1:]
    if args_list[:1] == ["bench"]:
        # bench parses its own arguments; everything after the word goes to it untouched.
        command, run = "bench", lambda: _bench(args_list[1:])
    else:
        try:
            args = _parser().parse_args(args_list)
        except SystemExit as exc:  # argparse already printed the error (or --help)
            return _exit_code(exc)
        command, run = args.command, lambda: args.func(args)
    handler = _OneLineHandler(debug)
    library_log = logging.getLogger("lightning_async_ckpt")
    library_log.addHandler(handler)
    try:
        return run()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`); point stdout at devnull so the exit-time flush stays quiet.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (ConfigError, CheckpointError, _UsageError, OSError) as exc:
        if debug:
            raise
        print(f"{PROG} {command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - storage backends raise their own types; keep the one-line contract
        if debug:
            raise
        print(
            f"{PROG} {command}: error: {type(exc).__name__}: {_one_line(exc)} (rerun as `{PROG} --debug ...` "
            "for the traceback)",
            file=sys.stderr,
        )
        return 2
    finally:
        library_log.removeHandler(handler)


class _OneLineHandler(logging.Handler):
    """Library warnings as one stderr line each (a traceback only with ``--debug``)."""

    def __init__(self, debug: bool) -> None:
        super().__init__(logging.DEBUG if debug else logging.WARNING)
        self.debug = debug

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{PROG}: {record.levelname.lower()}: {_one_line(record.getMessage())}"
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({type(record.exc_info[1]).__name__}: {_one_line(record.exc_info[1])})"
            if self.debug:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        print(text, file=sys.stderr)


# -- parser ----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Inspect, verify and clean checkpoint stores; plan checkpoint schedules; plot event logs.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options. Exit status: 0 ok, 1 verify failed, 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # Handled before parsing (it must come first); listed here for --help.
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def store_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("uri", help="store location: a local path, file://, memory://, s3://bucket/prefix, ...")
        p.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be "
            "(e.g. --storage-option endpoint_url=http://127.0.0.1:9000, anon=true)",
        )

    p = sub.add_parser("ls", help="list generations (committed or not) with step, size and age")
    store_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser(
        "verify", help="re-read generations and check sizes and checksums (never unpickles); exit 1 on failure"
    )
    store_args(p)
    p.add_argument(
        "--step",
        type=int,
        action="append",
        metavar="N",
        help="verify this step (repeatable); default: every "
        "committed generation, plus any whose manifest is present but invalid",
    )
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("gc", help="delete old generations, keeping the newest K committed ones")
    store_args(p)
    p.add_argument("--keep-last", type=int, required=True, metavar="K", help="committed generations to keep (>= 1)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--all-runs",
        action="store_true",
        help="apply --keep-last across generations written by several runs (needed when there are several)",
    )
    who.add_argument("--run-id", metavar="ID", help="only remove committed generations written by this run")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser(
        "plan",
        help="backlog model: will storage keep up? (rates, bytes, or a measured event log)",
        description="Fluid-queue backlog model. Give exactly one of: --arrival-rate/--drain-rate; "
        "--bytes/--interval/--bandwidth; --events.",
    )
    rates = p.add_argument_group("rates (any unit)")
    rates.add_argument("--arrival-rate", type=float, metavar="L", help="lambda: units arriving per second")
    rates.add_argument("--drain-rate", type=float, metavar="M", help="mu: units drained per second")
    sizes = p.add_argument_group("bytes (sizes accept units: 512MB, 4GiB, 200MB/s)")
    sizes.add_argument("--bytes", type=_size, metavar="B", help="bytes per checkpoint")
    sizes.add_argument("--interval", type=float, metavar="S", help="seconds between checkpoint requests")
    sizes.add_argument("--bandwidth", type=_size, metavar="W", help="persist throughput, bytes per second")
    p.add_argument("--events", metavar="FILE.jsonl", help="measure the rates from an event log instead")
    p.add_argument(
        "--backlog", type=_size, default=0.0, metavar="Q0", help="backlog now, in the rates' unit (default 0)"
    )
    p.add_argument("--horizon", type=float, metavar="T", help="also report the backlog after T seconds")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("timeline", help="plot an event log to a PNG (needs the [plot] extra)")
    p.add_argument("events", metavar="EVENTS.jsonl", help="event log written by the checkpointer")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    p.set_defaults(func=_cmd_timeline)

    sub.add_parser("bench", help="storage and staging benchmark (arguments are passed through)", add_help=False)
    return parser


# -- commands --------------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    store = _open_store(args)
    gens = store.generations(include_uncommitted=True)
    now = time.time()
    rows = []
    for g in gens:
        rows.append(
            {
                "step": g.step,
                "committed": g.committed,
                "bytes": g.manifest.total_bytes if g.manifest else None,
                "objects": len(g.manifest.objects) if g.manifest else None,
                "run_id": g.run_id,
                "committed_at": g.manifest.committed_at if g.manifest else None,
                "age_s": (now - g.mtime) if g.mtime else None,
                "path": g.path,
                "error": g.error,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no generations at {args.uri}", file=sys.stderr)
        return 0
    table = [("STEP", "STATE", "SIZE", "OBJECTS", "AGE", "RUN", "PATH")]
    for r in rows:
        state = "committed" if r["committed"] else ("INVALID" if r["error"] else "uncommitted")
        table.append(
            (
                str(r["step"]),
                state,
                _fmt_bytes(r["bytes"]) if r["bytes"] is not None else "-",
                str(r["objects"]) if r["objects"] is not None else "-",
                _fmt_age(r["age_s"]),
                r["run_id"] or "-",
                r["path"],
            )
        )
    _print_table(table)
    for r in rows:
        if r["error"]:
            print(f"step {r['step']}: manifest rejected: {_one_line(r['error'])}")
    committed = [r for r in rows if r["committed"]]
    total = sum(r["bytes"] for r in committed)
    print(f"{len(committed)} committed ({_fmt_bytes(total)}), {len(rows) - len(committed)} not committed")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    store = _open_store(args)
    gens = {g.step: g for g in store.generations(include_uncommitted=True)}
    skipped = []
    if args.step:
        missing = [s for s in args.step if s not in gens]
        if missing:
            steps = ", ".join(str(s) for s in sorted(gens)) or "none"
            raise _UsageError(f"no generation for step(s) {missing} at {args.uri} (steps there: {steps})")
        targets = list(dict.fromkeys(args.step))
    else:
        targets = [s for s, g in sorted(gens.items()) if g.committed or g.error]
        skipped = [s for s, g in sorted(gens.items()) if not g.committed and not g.error]
        if not targets:
            raise _UsageError(
                f"no committed generations at {args.uri}"
                + (f" (only uncommitted leftovers: {skipped})" if skipped else "; check the path")
            )
    results = [store.verify(step) for step in targets]
    failed = [r for r in results if not r.ok]
    if args.json:
        body = [
            {
                "step": r.step,
                "ok": r.ok,
                "problems": list(r.problems),
                "bytes": gens[r.step].manifest.total_bytes if gens[r.step].manifest else None,
            }
            for r in results
        ]
        print(json.dumps({"ok": not failed, "results": body, "skipped_uncommitted": skipped}, indent=1))
    else:
        for r in results:
            g = gens[r.step]
            if r.ok and g.manifest is not None:
                print(f"step {r.step}: OK ({len(g.manifest.objects)} objects, {_fmt_bytes(g.manifest.total_bytes)})")
            else:
                print(f"step {r.step}: FAILED")
                for problem in r.problems:
                    print(f"  {_one_line(problem)}")
        if skipped:
            print(f"skipped uncommitted (no manifest; in progress or a crashed write): steps {skipped}")
        print(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    if failed:
        print(f"{PROG} verify: {len(failed)} generation(s) failed: steps {[r.step for r in failed]}", file=sys.stderr)
        return 1
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    if args.keep_last < 1:
        raise ConfigError(f"--keep-last must be >= 1 (the newest committed generation is kept), got {args.keep_last}")
    store = _open_store(args, run_id=args.run_id)
    gens = store.generations(include_uncommitted=True)
    runs = sorted({g.run_id for g in gens if g.committed and g.run_id})
    if args.run_id is None and not args.all_runs and len(runs) > 1:
        raise _UsageError(
            f"{args.uri} holds generations of {len(runs)} runs ({', '.join(runs)}); pass --all-runs to keep the "
            "newest --keep-last across all of them, or --run-id ID to remove only that run's old generations"
        )
    if not gens:
        print(f"no generations at {args.uri}; nothing to do", file=sys.stderr)
    elif args.run_id is not None and args.run_id not in runs:
        print(f"note: no committed generation of run {args.run_id!r} here (runs: {runs})", file=sys.stderr)
    # Without --run-id the CLI is not a run: it acts for the whole folder (one run, or --all-runs).
    removed = store.gc(args.keep_last, all_runs=args.run_id is None, dry_run=args.dry_run)
    by_step = {g.step: g for g in gens}
    verb = "would remove" if args.dry_run else "removed"
    for step in removed:
        g = by_step.get(step)
        kind = "committed" if g is not None and g.committed else "uncommitted leftover"
        size = f", {_fmt_bytes(g.manifest.total_bytes)}" if g is not None and g.manifest else ""
        print(f"{verb} step {step} ({kind}{size})")
    kept = [g.step for g in gens if g.committed and g.step not in removed]
    print(f"{verb} {len(removed)} generation(s); committed steps kept: {kept}")
    if not args.dry_run:
        # The store's gc is best effort (it logs and goes on); whatever it would still remove is what failed.
        left = store.gc(args.keep_last, all_runs=args.run_id is None, dry_run=True)
        if left:
            print(f"{PROG} gc: could not remove steps {left}; run gc again", file=sys.stderr)
            return 1
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from lightning_async_ckpt.tools.planner import plan_from_bytes, plan_from_events, plan_from_rates, read_events

    rate_mode = args.arrival_rate is not None or args.drain_rate is not None
    byte_mode = any(v is not None for v in (args.bytes, args.interval, args.bandwidth))
    event_mode = args.events is not None
    if rate_mode + byte_mode + event_mode != 1:
        raise _UsageError(
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
            raise _UsageError("--backlog is measured from the log with --events; drop it")
        plan = plan_from_events(read_events(args.events), horizon=args.horizon)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    print(_format_plan(plan))
    return 0


def _cmd_timeline(args: argparse.Namespace) -> int:
    from lightning_async_ckpt.tools.timeline import plot_timeline

    out = plot_timeline(args.events, args.output)
    print(f"wrote {out}")
    return 0


def _bench(argv: list[str]) -> int:
    try:
        result = _load_bench().main(argv)
    except SystemExit as exc:  # its own argparse: --help, or a usage error it already printed
        return _exit_code(exc)
    return int(result or 0)


_BENCH_MODULE = "lightning_async_ckpt_bench"


def _load_bench() -> Any:
    """The benchmark lives beside the other benchmarks in the source checkout (``benchmarks/bench.py``)."""
    if _BENCH_MODULE in sys.modules:
        return sys.modules[_BENCH_MODULE]
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "bench.py")
    if not os.path.isfile(path):
        raise ConfigError(
            "bench ships with the source checkout (benchmarks/bench.py): run it from a clone of the repository"
        )
    spec = importlib.util.spec_from_file_location(_BENCH_MODULE, os.path.normpath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[_BENCH_MODULE] = module
    spec.loader.exec_module(module)
    return module


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 2


# -- helpers ---------------------------------------------------------------------------------------------
def _open_store(args: argparse.Namespace, run_id: str | None = None) -> Any:
    from lightning_async_ckpt.storage.store import CheckpointStore

    return CheckpointStore(args.uri, _storage_options(args.storage_option), run_id=run_id, check_writable=False)


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise _UsageError(f"--storage-option must be KEY=VALUE, got {pair!r}")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def _size(text: str) -> float:
    """Parse ``4GiB``, ``500MB``, ``200MB/s``, ``1e9``; argparse turns the ValueError into a usage error."""
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1000000, 512MB, 4GiB, 200MB/s)")
    return float(match.group(1)) * _SIZE_UNITS[unit]


def _require(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        needs = " ".join(f"--{n.replace('_', '-')}" for n in names)
        raise _UsageError(f"missing {' '.join(missing)} (this mode needs {needs})")


def _format_plan(plan: Any) -> str:
    in_bytes = plan.units == "bytes"

    def amount(v: float) -> str:
        return _fmt_bytes(v) if in_bytes else f"{v:.6g} units"

    def rate(v: float) -> str:
        sign = "-" if v < 0 else ""
        return f"{sign}{_fmt_bytes(abs(v))}/s" if in_bytes else f"{v:.6g} units/s"

    lines = [f"backlog model (fluid queue), from {plan.source}:"]
    if plan.bytes_per_checkpoint is not None and plan.interval_s is not None:
        lines.append(f"  checkpoint size (B)            {_fmt_bytes(plan.bytes_per_checkpoint)}")
        lines.append(f"  interval (S)                   {_fmt_s(plan.interval_s)}")
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
        + (_fmt_s(plan.min_interval_s) if plan.min_interval_s is not None else "n/a (needs bytes per checkpoint)"),
    ]
    if plan.recommended_interval_s is not None:
        lines.append(f"  interval with headroom         {_fmt_s(plan.recommended_interval_s)}")
    lines.append(f"  training stalled under 'wait'  {100 * plan.stall_fraction_if_wait:.1f}%")
    if plan.horizon_s is not None:
        lines.append(f"  backlog after {_fmt_s(plan.horizon_s):<16} {amount(plan.backlog_at_horizon)}")
    lines.append(f"  recommended admission          {plan.admission} (max_outstanding={plan.max_outstanding})")
    if plan.measured:
        m = plan.measured
        lines.append(
            f"measured: {m['requests']} requests over {_fmt_s(m['span_s'])}, training blocked "
            f"{_fmt_s(m['blocked_s_total'])} ({100 * m['blocked_fraction']:.1f}%), outcomes {m['outcomes']}"
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
    return _fmt_s(plan.drain_time)


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"  # pragma: no cover - loop always returns


def _fmt_s(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.4g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _version() -> str:
    from lightning_async_ckpt import __version__

    return __version__
