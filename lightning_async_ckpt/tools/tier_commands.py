"""``ls``, ``verify`` and ``gc`` of both tiers: ``dirpath`` (durable) and ``--local-dirpath`` (node-local).

Each row names its tier and holder. A generation is ``promoted`` when it was promoted from the local tier or
``dirpath`` holds its step committed, ``no`` when only the local tier does, ``replica`` when copied from another
rank. A local tier that does not exist is said so and is not an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lightning_async_ckpt.tools.gc_command import gc_store
from lightning_async_ckpt.tools.local_tiers import LocalStore, local_stores, unpromoted_guard
from lightning_async_ckpt.tools.store_commands import (
    UsageError,
    generation_row,
    ls_rows,
    open_store,
    print_ls_table,
    print_skipped,
    verify_status,
    verify_store,
)

__all__ = ["gc_tiers", "ls_tiers", "verify_tiers"]

DURABLE, LOCAL = "durable", "local"


def ls_tiers(args: argparse.Namespace) -> int:
    """``ls --local-dirpath``: one table of both tiers, with ``TIER``, ``PROMOTED`` and ``HOLDER`` columns
    (``--json``: the rows with ``tier``, ``promoted``, ``holder``, ``rank``, ``replica`` and ``version``)."""
    durable, _ = ls_rows(args, args.uri)
    local = _local_rows(args)
    promoted_steps = {r["step"] for r in durable if r["committed"]}
    for r in durable:
        r.update(tier=DURABLE, promoted="promoted" if r["promoted_from"] else "-", holder="-", rank=None)
        r.update(replica=False)
    for r in local:
        label = "yes" if r["step"] in promoted_steps else "no"
        r.update(tier=LOCAL, promoted=f"{label}, replica" if r["replica"] else label)
    rows = sorted(durable + local, key=lambda r: (r["step"], r["tier"] != DURABLE, r["version"], r["holder"]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no generations at {args.uri} nor at {args.local_dirpath}", file=sys.stderr)
        return 0
    print_ls_table(rows, tiers=True)
    newest = max((r["step"] for r in rows if r["committed"]), default=None)
    only_local = sorted({r["step"] for r in local if r["committed"] and r["step"] not in promoted_steps})
    if only_local:
        print(f"local only (not on {args.uri}; lost with the node unless replicated): steps {only_local}")
    _print_rank_coverage(local)
    if newest is not None:
        print(f"newest committed step across tiers: {newest}")
    return 0


def verify_tiers(args: argparse.Namespace) -> int:
    """``verify --local-dirpath``: every selected generation of the durable tier and of every local store (the
    single-writer folder, each ``rank-<r>`` and ``replica-of-rank-<r>`` of every version folder), each line prefixed
    with its tier and store; exit 1 when one failed anywhere."""
    durable, durable_lines = verify_store(args, args.uri, tiered=True)
    tiers: list[tuple[str, str, LocalStore | None, dict[str, Any] | None, list[str]]] = [
        (DURABLE, args.uri, None, durable, durable_lines)
    ]
    if _local_exists(args):
        for st in local_stores(args.local_dirpath):
            body, lines = verify_store(args, st.uri, local=True, tiered=True)
            tiers.append((LOCAL, st.uri, st, body, lines))
    else:
        tiers.append((LOCAL, args.local_dirpath, None, None, [f"no local tier at {args.local_dirpath}"]))
    promoted = {r["step"] for r in durable["results"]}
    checked = [r for *_, body, _ in tiers if body is not None for r in body["results"]]
    if not checked:
        raise UsageError(
            f"nothing to verify at {args.uri} nor at {args.local_dirpath}"
            + (f" for step(s) {args.step}" if args.step else " (no committed generations)")
        )
    failed = [f"{_where(t, st)}:{s}" for t, _, st, body, _ in tiers if body is not None for s in body["failed"]]
    if args.json:
        out = []
        for tier, uri, st, body, _ in tiers:
            if tier == LOCAL:
                for r in body["results"] if body is not None else []:
                    r["promoted"] = r["step"] in promoted
            entry = {"tier": tier, "uri": uri, **_store_fields(st)}
            out.append({**entry, **(body if body is not None else {"ok": True, "results": [], "missing": True})})
        print(json.dumps({"ok": not failed, "tiers": out}, indent=1))
    else:
        for tier, _, st, _, lines in tiers:
            head = f"{tier} {st.name}" if st is not None and st.name else tier
            for line in lines:
                step = _step_of_line(line)
                mark = " [promoted]" if tier == LOCAL and step in promoted else ""
                print(f"{head} {line}{mark}" if not line.startswith("  ") else f"{' ' * len(head)} {line}")
        print(f"{len(checked) - len(failed)} ok, {len(failed)} failed (both tiers)")
    return verify_status(failed)


def gc_tiers(args: argparse.Namespace) -> int:
    """``gc --local-dirpath``: ``--keep-last`` on ``dirpath``, then on every local store (each under a header
    line); the exit status is the worst. A local store of this node's own generations also keeps every step newer
    than the durable tier's newest (:func:`unpromoted_guard`); a ``replica-of-rank-<r>`` folder gets ``--keep-last``
    only, as the replicator applies it."""
    durable, _ = ls_rows(argparse.Namespace(**{**vars(args), "json": True}), args.uri)  # skipped entries: stderr
    print(f"== {DURABLE} tier: {args.uri}")
    status = gc_store(args, args.uri)
    if not _local_exists(args):
        print(f"== {LOCAL} tier: {args.local_dirpath}")
        print(f"no local tier at {args.local_dirpath}; nothing to do", file=sys.stderr)
        return status
    for st in local_stores(args.local_dirpath):
        print(f"== {LOCAL} tier: {st.uri}" + (f" ({_holder(st, None)})" if st.name else ""))
        guard: frozenset[int] = frozenset()
        if not st.replica:
            steps = [g.step for g in open_store(args, uri=st.uri, local=True).generations()]
            guard, why = unpromoted_guard(steps, durable)
            if guard:
                print(f"kept steps {sorted(guard)}: {why}")
        status = max(status, gc_store(args, st.uri, local=True, protect=guard))
    return status


def _local_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not _local_exists(args):
        print(f"no local tier at {args.local_dirpath} (a lost or fresh node): durable tier only", file=sys.stderr)
        return []
    rows = []
    now = time.time()
    for st in local_stores(args.local_dirpath):
        listing = open_store(args, uri=st.uri, local=True).scan(include_uncommitted=True)
        print_skipped(listing.skipped, to_stderr=args.json)
        for g in listing.generations:
            row = generation_row(g, st.version, now)
            replica_of = row["replica_of"] if st.rank is None else None
            row.update(
                holder=_holder(st, replica_of),
                rank=st.rank if st.rank is not None else (replica_of or {}).get("rank"),
                replica=st.replica or bool(replica_of),
                local_store=st.uri,
                local_tier=g.manifest.extra.get("local_tier") if g.manifest else None,
            )
            rows.append(row)
    return rows


def _holder(st: LocalStore, replica_of: dict[str, Any] | None) -> str:
    """The ``HOLDER`` label: ``rank-<r>`` / ``replica-of-rank-<r>`` (DCP), ``writer`` / ``replica-of-rank-<r>``
    (single-writer, from the manifest's ``replica_of``), under ``v<k>/`` in a version folder."""
    if st.rank is not None:
        return st.name
    leaf = f"replica-of-rank-{replica_of.get('rank')}" if replica_of else "writer"
    return f"v{st.version}/{leaf}" if st.version else leaf


def _store_fields(st: LocalStore | None) -> dict[str, Any]:
    if st is None:
        return {}
    return {"store": st.name, "version": st.version, "rank": st.rank, "replica": st.replica}


def _where(tier: str, st: LocalStore | None) -> str:
    return f"{tier}/{st.name}" if st is not None and st.name else tier


def _print_rank_coverage(local: list[dict[str, Any]]) -> None:
    """Under the DCP layout a local step is usable only when every rank holds it: name the steps some rank lacks
    (by the world size each rank's manifest records)."""
    held: dict[tuple[int, int], set[int]] = {}
    sizes: dict[tuple[int, int], int] = {}
    for r in local:
        if r["committed"] and not r["replica"] and r["rank"] is not None:
            held.setdefault((r["version"], r["step"]), set()).add(r["rank"])
            mark = r.get("local_tier") or {}
            if mark.get("world_size"):
                sizes[(r["version"], r["step"])] = int(mark["world_size"])
    for (version, step), ranks in sorted(held.items()):
        size = sizes.get((version, step))
        if size is not None and len(ranks) < size:
            lacking = sorted(set(range(size)) - ranks)
            where = f"v{version}/" if version else ""
            print(
                f"step {step} ({where}rank-*): this folder lacks ranks {lacking} of {size} (their own node may hold them)"
            )


def _local_exists(args: argparse.Namespace) -> bool:
    store = open_store(args, uri=args.local_dirpath, local=True)
    if store.fs.exists(store.root) and not store.fs.isdir(store.root):
        raise UsageError(f"--local-dirpath {args.local_dirpath} is a file, not a folder")
    return bool(store.fs.exists(store.root))


def _step_of_line(line: str) -> int | None:
    head = line.split(":", 1)[0]
    return int(head[5:]) if head.startswith("step ") and head[5:].isdigit() else None
