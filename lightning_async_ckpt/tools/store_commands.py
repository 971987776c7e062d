"""The store commands of the command line: ``ls`` and ``verify`` of one store, and the helpers every command shares.

Each takes the parsed arguments and returns the exit status; bad input raises :class:`UsageError` (or a
library ``ConfigError``/``CheckpointError``), which ``cli.main`` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lightning_async_ckpt.storage.finder import manifest_gone
from lightning_async_ckpt.storage.generation import subfolders_holding_checkpoints, version_folders
from lightning_async_ckpt.tools.fmt import fmt_age, fmt_bytes, one_line, print_table

__all__ = [
    "PROG",
    "UsageError",
    "accelerate_folders_at",
    "generation_row",
    "ls_rows",
    "ls_store",
    "open_store",
    "print_committed_summary",
    "print_ls_table",
    "print_skipped",
    "storage_options",
    "verify_one",
    "verify_status",
    "verify_store",
]

PROG = "lightning-async-ckpt"


class UsageError(Exception):
    """Bad input found after parsing; the command line exits 2 with the message."""


def ls_store(args: argparse.Namespace) -> int:
    """``ls`` of one store: its generations (committed or not) with step, size, age and run, also those of the
    version folders (``v1/``, ...) that ``latest_checkpoint(dirpath)`` and ``ckpt_path="last"`` pick from."""
    rows, versions = ls_rows(args, args.uri)
    if not rows:
        _check_store_path(open_store(args), args.uri)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no generations at {args.uri}{other_checkpoints(open_store(args))}", file=sys.stderr)
        return 0
    print_ls_table(rows)
    if versions:
        names = ", ".join(f"v{v}/" for v in versions)
        print(
            f"version folders {names} hold re-runs of the script; latest_checkpoint(dirpath) and "
            "ckpt_path='last' pick the newest step of the highest version that holds an intact checkpoint"
        )
    return 0


def ls_rows(args: argparse.Namespace, uri: str, *, local: bool = False) -> tuple[list[dict[str, Any]], list[int]]:
    """One row per generation of ``uri`` and of its version folders (``ls``'s rows), and those versions.

    Args:
        args: The parsed arguments (``--storage-option`` applies unless ``local``).
        uri: The store location.
        local: A node-local tier: opened without the storage options.
    """
    store = open_store(args, uri=uri, local=local)
    listing = store.scan(include_uncommitted=True)
    print_skipped(listing.skipped, to_stderr=args.json)
    versions = version_folders(store.fs, store.root)
    located = [(0, g) for g in listing.generations]
    for version in versions:
        inner = open_store(args, uri=f"{uri.rstrip('/')}/v{version}", local=local).scan(include_uncommitted=True)
        print_skipped(inner.skipped, to_stderr=args.json)
        located += [(version, g) for g in inner.generations]
    now = time.time()
    return [generation_row(g, version, now) for version, g in located], versions


def generation_row(g: Any, version: int, now: float) -> dict[str, Any]:
    """``ls``'s row (``--json`` object) of listed generation ``g`` of version folder ``version`` (0: the store)."""
    return {
        "version": version,
        "step": g.step,
        "committed": g.committed,
        "bytes": g.manifest.total_bytes if g.manifest else None,
        "objects": len(g.manifest.objects) if g.manifest else None,
        "format": g.manifest.checkpoint_format if g.manifest else None,
        "ranks": _rank_bytes(g.manifest),
        "run_id": g.run_id,
        "committed_at": g.manifest.committed_at if g.manifest else None,
        "age_s": (now - g.mtime) if g.mtime else None,
        "path": g.path,
        "error": g.error,
        "promoted_from": g.manifest.extra.get("promoted_from") if g.manifest else None,
        "replica_of": g.manifest.extra.get("replica_of") if g.manifest else None,
    }


def print_ls_table(rows: list[dict[str, Any]], *, tiers: bool = False) -> None:
    """``ls``'s table of ``rows`` (with ``TIER`` and ``PROMOTED`` columns when ``tiers``), rejected manifests, the
    summary line."""
    head = ("STATE", "SIZE", "OBJECTS", "AGE", "RUN", "RANKS", "PATH")
    table = [(("TIER", "PROMOTED", "STEP", "HOLDER") if tiers else ("STEP",)) + head]
    for r in rows:
        state = "committed" if r["committed"] else ("INVALID" if r["error"] else "uncommitted")
        label = (r["tier"], r["promoted"], str(r["step"]), r["holder"]) if tiers else (str(r["step"]),)
        table.append(
            label
            + (
                state,
                fmt_bytes(r["bytes"]),
                str(r["objects"]) if r["objects"] is not None else "-",
                fmt_age(r["age_s"]),
                r["run_id"] or "-",
                _fmt_ranks(r["ranks"]),
                r["path"],
            )
        )
    print_table(table)
    for r in rows:
        if r["error"]:
            where = f"{r['tier']} " if tiers else ""
            print(f"{where}step {r['step']}: manifest rejected: {one_line(r['error'])}")
    print_committed_summary(rows)


def print_committed_summary(rows: list[dict[str, Any]]) -> None:
    """The last line of ``ls``: how many rows are committed (and their bytes), how many are not."""
    committed = [r for r in rows if r["committed"]]
    total = sum(r["bytes"] for r in committed)
    print(f"{len(committed)} committed ({fmt_bytes(total)}), {len(rows) - len(committed)} not committed")


def _rank_bytes(manifest: Any) -> dict[str, int] | None:
    """A multi-rank (sharded) generation's bytes per writing rank; ``None`` for a single-writer generation."""
    ranks = manifest.ranks if manifest is not None else {}
    return {str(rank): sum(e.size for e in entries) for rank, entries in ranks.items()} or None


def _fmt_ranks(ranks: dict[str, int] | None) -> str:
    if not ranks:
        return "-"
    return ",".join(f"{rank}:{fmt_bytes(size).replace(' ', '')}" for rank, size in ranks.items())


def verify_one(args: argparse.Namespace) -> int:
    """``verify`` of one store: re-read its generations and check sizes and checksums; 1 when any failed."""
    body, lines = verify_store(args, args.uri)
    if args.json:
        print(json.dumps(body, indent=1))
    else:
        print("\n".join(lines))
        print(f"{len(body['results']) - len(body['failed'])} ok, {len(body['failed'])} failed")
    return verify_status(body["failed"])


def verify_status(failed: list[int]) -> int:
    """``verify``'s exit status (1 when a generation failed, named on stderr)."""
    if failed:
        print(f"{PROG} verify: {len(failed)} generation(s) failed: steps {failed}", file=sys.stderr)
        return 1
    return 0


def verify_store(
    args: argparse.Namespace, uri: str, *, local: bool = False, tiered: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """Verify the generations of ``uri`` that ``args`` selects: the JSON body and the text lines.

    Args:
        args: The parsed arguments (``--step``, ``--json``, ``--storage-option``).
        uri: The store location.
        local: A node-local tier: opened without the storage options.
        tiered: One of two tiers: a ``--step`` or committed generation missing here is not bad input (the other
            tier may hold it).

    Raises:
        UsageError: A ``--step`` without a generation, or nothing committed (unless ``tiered``).
    """
    store = open_store(args, uri=uri, local=local)
    listing = store.scan(include_uncommitted=True)
    print_skipped(listing.skipped, to_stderr=args.json)
    gens = {g.step: g for g in listing.generations}
    skipped = []
    if args.step:
        missing = [s for s in args.step if s not in gens]
        if missing and not tiered:
            steps = ", ".join(str(s) for s in sorted(gens)) or "none"
            raise UsageError(f"no generation for step(s) {missing} at {uri} (steps there: {steps})")
        targets = [s for s in dict.fromkeys(args.step) if s in gens]
    else:
        targets = [s for s, g in sorted(gens.items()) if g.committed or g.error]
        skipped = [s for s, g in sorted(gens.items()) if not g.committed and not g.error]
        if not targets and not tiered:
            raise UsageError(
                f"no committed generations at {uri}"
                + (
                    f" (only uncommitted leftovers: {skipped})"
                    if skipped
                    else other_checkpoints(store) or "; check the path"
                )
            )
    results = [store.verify(step) for step in targets]
    # A committed generation whose manifest is gone now was retired by a running writer while it was read: not damage.
    removed = {r.step for r in results if not r.ok and gens[r.step].committed and manifest_gone(store, r.step)}
    results = [r for r in results if r.step not in removed]
    body = {
        "ok": all(r.ok for r in results),
        "results": [
            {
                "step": r.step,
                "ok": r.ok,
                "problems": list(r.problems),
                "bytes": gens[r.step].manifest.total_bytes if gens[r.step].manifest else None,
                "ranks": _rank_bytes(gens[r.step].manifest),
                "promoted_from": gens[r.step].manifest.extra.get("promoted_from") if gens[r.step].manifest else None,
            }
            for r in results
        ],
        "failed": [r.step for r in results if not r.ok],
        "skipped_uncommitted": skipped,
        "skipped_entries": [{"name": e.name, "reason": e.reason} for e in listing.skipped],
        "removed_while_verified": sorted(removed),
    }
    lines = []
    for r in results:
        g = gens[r.step]
        if r.ok and g.manifest is not None:
            ranks = _rank_bytes(g.manifest)
            by = f", {len(ranks)} ranks" if ranks else ""
            size = f"{len(g.manifest.objects)} objects, {fmt_bytes(g.manifest.total_bytes)}{by}"
            lines.append(f"step {r.step}: OK ({size}) {_on_disk(store, g)}")
        else:
            lines.append(f"step {r.step}: FAILED ({_on_disk(store, g)})")
            lines += [f"  {one_line(_problem_on_disk(store, g, problem))}" for problem in r.problems]
    lines += [f"step {s}: removed while it was verified (a writer's retention): not checked" for s in sorted(removed)]
    if skipped:
        lines.append(f"skipped uncommitted (no manifest; in progress or a crashed write): steps {skipped}")
    return body, lines


def _on_disk(store: Any, g: Any) -> str:
    """Where a generation is on disk: its one object's path (the checkpoint file), else its folder."""
    objects = g.manifest.objects if g.manifest is not None else []
    return store.url(g.step, objects[0].key) if len(objects) == 1 else store.url(g.step)


def _problem_on_disk(store: Any, g: Any, problem: str) -> str:
    """A verify problem naming the object's path on disk (the manifest's name, e.g. ``checkpoint.ckpt``, is a
    label: the callback's file is named by its ``filename`` template)."""
    for obj in g.manifest.objects if g.manifest is not None else []:
        if obj.key != obj.name and problem.startswith(f"{obj.name}:"):
            return store.url(g.step, obj.key) + problem[len(obj.name) :]
    return problem


def accelerate_folders_at(args: argparse.Namespace) -> list[Any] | None:
    """Accelerate's checkpoint folders at ``args.uri``, or ``None`` when it is not such a layout (a store)."""
    from lightning_async_ckpt.accelerate.folders import accelerate_folders

    return accelerate_folders(args.uri, storage_options(args.storage_option))


def print_skipped(skipped: list[Any], *, to_stderr: bool) -> None:
    """Name every folder entry the listing did not read as a generation (never skipped silently)."""
    for entry in skipped:
        print(f"skipped {entry.name}: {entry.reason}", file=sys.stderr if to_stderr else sys.stdout)


def other_checkpoints(store: Any) -> str:
    """``""``, or what tells a user that ``store``'s folder holds ``ModelCheckpoint`` (``.ckpt``) files instead."""
    try:
        files = sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in store.fs.glob(f"{store.root}/*.ckpt"))
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if not files:
        return ""
    shown = ", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
    return (
        f"; it holds ModelCheckpoint files ({shown}): load one with trainer.fit(ckpt_path=...); this library's "
        "generations are step-* folders (AsyncCheckpointCallback's dirpath)"
    )


def _check_store_path(store: Any, uri: str) -> None:
    """An empty listing is fine for an existing (empty) store folder; a missing path or a file is a usage error."""
    if not store.fs.exists(store.root):
        raise UsageError(f"no such store: {uri} does not exist (check the path, or the bucket and prefix)")
    if not store.fs.isdir(store.root):
        raise UsageError(f"{uri} is a file, not a store folder (pass the folder that holds step-* generations)")
    nested = subfolders_holding_checkpoints(store.fs, store.root)
    if nested:
        raise UsageError(f"no generations directly at {uri}; these subfolders hold some: {', '.join(nested[:5])}")


def open_store(
    args: argparse.Namespace, run_id: str | None = None, uri: str | None = None, *, local: bool = False
) -> Any:
    """The store named by ``args.uri`` (or ``uri``) and ``args.storage_option`` (none for a ``local`` tier), opened
    read-mostly (no writability probe)."""
    from lightning_async_ckpt.storage.store import CheckpointStore

    options = None if local else storage_options(args.storage_option)
    return CheckpointStore(uri or args.uri, options, run_id=run_id, check_writable=False)


def storage_options(pairs: list[str]) -> dict[str, Any]:
    """Parse repeated ``--storage-option KEY=VALUE`` (VALUE as JSON when it parses, else the string)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--storage-option must be KEY=VALUE, got {pair!r}")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options
