"""The ``lightning-async-ckpt`` command line: list, verify, garbage-collect and export a store, plan, plot, bench.

Every command exits 0 on success, 1 when ``verify`` finds a damaged generation, and 2 on bad input, with a
one-line message on stderr and no traceback (``--debug`` before the command shows it). See ``docs/cli.md``.
``ls``, ``verify`` and ``gc`` dispatch here by location: both tiers with ``--local-dirpath`` (``tier_commands``),
accelerate's folders (``folder_commands``), else one store (``store_commands``, ``gc_command``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from lightning_async_ckpt.errors import CheckpointError, ConfigError
from lightning_async_ckpt.tools.export_command import add_export_parser
from lightning_async_ckpt.tools.fmt import one_line
from lightning_async_ckpt.tools.folder_commands import ls_folders, verify_folders
from lightning_async_ckpt.tools.gc_command import check_gc, gc_store
from lightning_async_ckpt.tools.plan_commands import (
    cmd_plan,
    cmd_timeline,
    exit_code,
    parse_duration,
    parse_size,
    run_bench,
)
from lightning_async_ckpt.tools.store_commands import PROG, UsageError, accelerate_folders_at, ls_store, verify_one
from lightning_async_ckpt.tools.tier_commands import gc_tiers, ls_tiers, verify_tiers

__all__ = ["build_parser", "main"]


def cmd_ls(args: argparse.Namespace) -> int:
    """``ls``: list generations (committed or not) with step, size, age and run, also those of the version folders;
    or accelerate's folders; with ``--local-dirpath``, both tiers in one table."""
    if getattr(args, "local_dirpath", None):
        return ls_tiers(args)
    folders = accelerate_folders_at(args)
    return ls_store(args) if folders is None else ls_folders(args, folders)


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify``: re-read generations (or accelerate's folders) and check sizes and checksums; 1 when any failed.
    With ``--local-dirpath``, both tiers."""
    if getattr(args, "local_dirpath", None):
        return verify_tiers(args)
    folders = accelerate_folders_at(args)
    return verify_one(args) if folders is None else verify_folders(args, folders)


def cmd_gc(args: argparse.Namespace) -> int:
    """``gc``: delete old generations, keeping the newest ``--keep-last`` committed ones and the ``--keep-best``
    best ones by the score their manifests record (the callback's ``best_model_path`` and its top k); both tiers
    with ``--local-dirpath``."""
    check_gc(args)
    return gc_tiers(args) if getattr(args, "local_dirpath", None) else gc_store(args, args.uri)


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
        command, run = "bench", lambda: run_bench(args_list[1:])
    else:
        try:
            args = build_parser().parse_args(args_list)
        except SystemExit as exc:  # argparse already printed the error (or --help)
            return exit_code(exc)
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
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ConfigError, CheckpointError, UsageError, OSError) as exc:
        if debug:
            raise
        print(f"{PROG} {command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - storage backends raise their own types; keep the one-line contract
        if debug:
            raise
        print(
            f"{PROG} {command}: error: {type(exc).__name__}: {one_line(exc)} (rerun as `{PROG} --debug ...` "
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
        text = f"{PROG}: {record.levelname.lower()}: {one_line(record.getMessage())}"
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({type(record.exc_info[1]).__name__}: {one_line(record.exc_info[1])})"
            if self.debug:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        print(text, file=sys.stderr)


# -- parser ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The parser of every command but ``bench`` (which parses its own arguments: ``bench --help``)."""
    parser = _Parser(
        prog=PROG,
        description="Inspect, verify and clean checkpoint stores; plan checkpoint schedules; plot event logs.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options. Exit status: 0 ok, 1 verify failed, 2 bad input.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version and exit"
    )
    # Handled before parsing (it must come first); listed here for --help.
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def store_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "uri",
            help=(
                "store location (a local path, file://, memory://, s3://bucket/prefix, ...), or accelerate's "
                "checkpoint folders: <project_dir>/checkpoints or one save_state folder"
            ),
        )
        p.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be "
            "(e.g. --storage-option endpoint_url=http://127.0.0.1:9000, anon=true)",
        )
        p.add_argument(
            "--local-dirpath",
            metavar="PATH",
            help="the node-local tier (the callback's local_dirpath): show, verify or collect it too, each "
            "generation labelled with its tier and whether it was promoted to URI (storage options apply to URI only)",
        )

    p = sub.add_parser(
        "ls", help="list generations (committed or not) with step, size and age; accelerate checkpoint_N folders too"
    )
    store_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_ls)

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
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="delete old generations, keeping the newest K committed ones and the best ones")
    store_args(p)
    p.add_argument("--keep-last", type=int, required=True, metavar="K", help="committed generations to keep (>= 1)")
    p.add_argument(
        "--keep-best",
        type=int,
        default=1,
        metavar="K",
        help="also keep the K best committed generations by the score their manifests record (the callback's "
        "monitor; default 1: its best_model_path); 0 lets gc remove them (with a warning)",
    )
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--all-runs",
        action="store_true",
        help="apply --keep-last across generations written by several runs (needed when there are several)",
    )
    who.add_argument("--run-id", metavar="ID", help="only remove committed generations written by this run")
    p.set_defaults(func=cmd_gc)

    add_export_parser(sub)  # export STORE STEP --format safetensors (export_command.py)

    p = sub.add_parser(
        "plan",
        help="models: will storage keep up (backlog)? requests per save/resume at scale? recovery and goodput?",
        description="Give exactly one model's flags: the backlog model (--arrival-rate/--drain-rate; "
        "--bytes/--interval/--bandwidth; --events), the request model (--ranks/--generations ...) or the "
        "recovery model (--state-bytes ...). See docs/backlog-model.md.",
    )
    rates = p.add_argument_group("backlog model: rates (any unit)")
    rates.add_argument("--arrival-rate", type=float, metavar="L", help="lambda: units arriving per second")
    rates.add_argument("--drain-rate", type=float, metavar="M", help="mu: units drained per second")
    sizes = p.add_argument_group("backlog model: bytes (sizes accept units: 512MB, 4GiB, 200MB/s)")
    sizes.add_argument("--bytes", type=parse_size, metavar="B", help="bytes per checkpoint")
    sizes.add_argument("--interval", type=float, metavar="S", help="seconds between checkpoint requests")
    sizes.add_argument("--bandwidth", type=parse_size, metavar="W", help="persist throughput, bytes per second")
    p.add_argument("--events", metavar="FILE.jsonl", help="measure the rates from an event log instead")
    p.add_argument(
        "--backlog", type=parse_size, default=0.0, metavar="Q0", help="backlog now, in the rates' unit (default 0)"
    )
    p.add_argument("--horizon", type=float, metavar="T", help="also report the backlog after T seconds")
    req = p.add_argument_group("request model: object-store requests and time per save and per resume")
    req.add_argument("--ranks", type=int, metavar="N", help="ranks writing one sharded generation (default 1)")
    req.add_argument("--generations", type=int, metavar="G", help="generations already in the folder")
    req.add_argument("--keep-last", type=int, metavar="K", help="retention's keep_last (default 2)")
    req.add_argument(
        "--request-latency", type=parse_duration, metavar="T", help="time per request: 15ms, 0.015 (default 15ms)"
    )
    req.add_argument("--put-rate", type=float, metavar="R", help="PUT/POST/DELETE per second on the prefix (S3: 3500)")
    req.add_argument("--get-rate", type=float, metavar="R", help="GET/HEAD/LIST per second on the prefix (S3: 5500)")
    rec = p.add_argument_group("recovery model: restore time, lost work and goodput under preemptions")
    rec.add_argument("--state-bytes", type=parse_size, metavar="B", help="bytes per checkpoint (10GiB)")
    rec.add_argument("--local-bandwidth", type=parse_size, metavar="W", help="local tier read/write bytes/s (2GB/s)")
    rec.add_argument("--durable-bandwidth", type=parse_size, metavar="W", help="durable tier bytes/s (200MB/s)")
    rec.add_argument("--local-every", type=parse_duration, metavar="T", help="training time between local cuts")
    rec.add_argument("--durable-every", type=parse_duration, metavar="T", help="training time between durable ones")
    rec.add_argument("--preempt-every", type=parse_duration, metavar="T", help="mean time between preemptions")
    rec.add_argument("--startup", type=parse_duration, metavar="T", help="restart time before the read (default 0)")
    rec.add_argument("--node-loss", type=float, metavar="F", help="fraction of preemptions losing the local tier")
    rec.add_argument("--blocking", type=parse_duration, metavar="T", help="training-thread time per async save")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("timeline", help="plot an event log to a PNG (needs the [plot] extra)")
    p.add_argument("events", metavar="EVENTS.jsonl", help="event log written by the checkpointer")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default timeline.png)")
    p.set_defaults(func=cmd_timeline)

    sub.add_parser(
        "bench",
        help="every checkpointing approach on one model in one run, with the floors (see `bench --help`)",
        add_help=False,
    )
    return parser


def _version() -> str:
    from lightning_async_ckpt import __version__

    return __version__
