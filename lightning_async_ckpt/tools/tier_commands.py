"""``ls``, ``verify`` and ``gc`` of both tiers: ``dirpath`` (durable) and ``--local-dirpath`` (node-local).

Each row or line names its tier. A durable generation is ``promoted`` when its manifest records where it was
promoted from (``extra["promoted_from"]``); a local one is ``promoted`` when ``dirpath`` (or one of its version
folders) holds that step committed, ``no`` when only the local tier does (progress a lost node would lose), and
``replica`` marks a local generation copied there from another rank (``extra["replica_of"]``). A local tier that
does not exist (a lost node, a fresh one) is said so and is not an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_async_ckpt.tools.gc_command import gc_store
from lightning_async_ckpt.tools.store_commands import (
    UsageError,
    ls_rows,
    open_store,
    print_ls_table,
    verify_status,
    verify_store,
)

__all__ = ["gc_tiers", "ls_tiers", "verify_tiers"]

DURABLE, LOCAL = "durable", "local"


def ls_tiers(args: argparse.Namespace) -> int:
    """``ls --local-dirpath``: one table of both tiers, with ``TIER`` and ``PROMOTED`` columns (``--json``: the
    rows with ``tier`` and ``promoted``)."""
    durable, _ = ls_rows(args, args.uri)
    local = _local_rows(args)
    promoted_steps = {r["step"] for r in durable if r["committed"]}
    for r in durable:
        r.update(tier=DURABLE, promoted="promoted" if r["promoted_from"] else "-")
    for r in local:
        label = "yes" if r["step"] in promoted_steps else "no"
        r.update(tier=LOCAL, promoted=f"{label}, replica" if r["replica_of"] else label)
    rows = sorted(durable + local, key=lambda r: (r["step"], r["tier"] != DURABLE))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no generations at {args.uri} nor at {args.local_dirpath}", file=sys.stderr)
        return 0
    print_ls_table(rows, tiers=True)
    newest = max((r["step"] for r in rows if r["committed"]), default=None)
    only_local = sorted(r["step"] for r in local if r["committed"] and r["step"] not in promoted_steps)
    if only_local:
        print(f"local only (not on {args.uri}; lost with the node unless replicated): steps {only_local}")
    if newest is not None:
        print(f"newest committed step across tiers: {newest}")
    return 0


def verify_tiers(args: argparse.Namespace) -> int:
    """``verify --local-dirpath``: every selected generation of both tiers, each line prefixed with its tier; exit 1
    when one failed in either tier."""
    durable, durable_lines = verify_store(args, args.uri, tiered=True)
    if _local_exists(args):
        local, local_lines = verify_store(args, args.local_dirpath, local=True, tiered=True)
    else:
        local, local_lines = None, [f"no local tier at {args.local_dirpath}"]
    promoted = {r["step"] for r in durable["results"]}
    tiers = [(DURABLE, args.uri, durable, durable_lines), (LOCAL, args.local_dirpath, local, local_lines)]
    checked = [r for _, _, body, _ in tiers if body is not None for r in body["results"]]
    if not checked:
        raise UsageError(
            f"nothing to verify at {args.uri} nor at {args.local_dirpath}"
            + (f" for step(s) {args.step}" if args.step else " (no committed generations)")
        )
    failed = [f"{tier}:{s}" for tier, _, body, _ in tiers if body is not None for s in body["failed"]]
    if args.json:
        for r in local["results"] if local is not None else []:
            r["promoted"] = r["step"] in promoted
        out = [
            {"tier": t, "uri": u, **(b if b is not None else {"ok": True, "results": [], "missing": True})}
            for t, u, b, _ in tiers
        ]
        print(json.dumps({"ok": not failed, "tiers": out}, indent=1))
    else:
        for tier, _, _, lines in tiers:
            for line in lines:
                step = _step_of_line(line)
                mark = " [promoted]" if tier == LOCAL and step in promoted else ""
                print(f"{tier} {line}{mark}" if not line.startswith("  ") else f"{' ' * len(tier)} {line}")
        print(f"{len(checked) - len(failed)} ok, {len(failed)} failed (both tiers)")
    return verify_status(failed)


def gc_tiers(args: argparse.Namespace) -> int:
    """``gc --local-dirpath``: ``--keep-last`` on ``dirpath``, then on the local tier (each under a header line);
    the exit status is the worse of the two."""
    print(f"== {DURABLE} tier: {args.uri}")
    status = gc_store(args, args.uri)
    print(f"== {LOCAL} tier: {args.local_dirpath}")
    if not _local_exists(args):
        print(f"no local tier at {args.local_dirpath}; nothing to do", file=sys.stderr)
        return status
    return max(status, gc_store(args, args.local_dirpath, local=True))


def _local_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not _local_exists(args):
        print(f"no local tier at {args.local_dirpath} (a lost or fresh node): durable tier only", file=sys.stderr)
        return []
    rows, _ = ls_rows(args, args.local_dirpath, local=True)
    return rows


def _local_exists(args: argparse.Namespace) -> bool:
    store = open_store(args, uri=args.local_dirpath, local=True)
    if store.fs.exists(store.root) and not store.fs.isdir(store.root):
        raise UsageError(f"--local-dirpath {args.local_dirpath} is a file, not a folder")
    return bool(store.fs.exists(store.root))


def _step_of_line(line: str) -> int | None:
    head = line.split(":", 1)[0]
    return int(head[5:]) if head.startswith("step ") and head[5:].isdigit() else None
