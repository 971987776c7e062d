"""The store commands of the command line: ``ls``, ``verify`` and ``gc``.

Each takes the parsed arguments and returns the exit status; bad input raises :class:`UsageError` (or a
library ``ConfigError``/``CheckpointError``), which ``cli.main`` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.storage.generation import subfolders_holding_checkpoints, version_folders
from lightning_async_ckpt.tools.fmt import fmt_age, fmt_bytes, one_line, print_table

__all__ = [
    "PROG",
    "UsageError",
    "cmd_gc",
    "cmd_ls",
    "cmd_verify",
    "open_store",
    "print_committed_summary",
    "storage_options",
]

PROG = "lightning-async-ckpt"


class UsageError(Exception):
    """Bad input found after parsing; the command line exits 2 with the message."""


def cmd_ls(args: argparse.Namespace) -> int:
    """``ls``: list generations (committed or not) with step, size, age and run, also those of the version folders
    (``v1/``, ...) that ``latest_checkpoint(dirpath)`` and ``ckpt_path="last"`` pick from; or accelerate's folders."""
    folders = _accelerate_folders(args)
    if folders is not None:
        from lightning_async_ckpt.tools.folder_commands import ls_folders

        return ls_folders(args, folders)
    store = open_store(args)
    listing = store.scan(include_uncommitted=True)
    _print_skipped(listing.skipped, to_stderr=args.json)
    versions = version_folders(store.fs, store.root)
    located = [(0, g) for g in listing.generations]
    for version in versions:
        inner = open_store(args, uri=f"{args.uri.rstrip('/')}/v{version}").scan(include_uncommitted=True)
        _print_skipped(inner.skipped, to_stderr=args.json)
        located += [(version, g) for g in inner.generations]
    now = time.time()
    rows = []
    for version, g in located:
        rows.append(
            {
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
            }
        )
    if not rows:
        _check_store_path(store, args.uri)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no generations at {args.uri}", file=sys.stderr)
        return 0
    table = [("STEP", "STATE", "SIZE", "OBJECTS", "AGE", "RUN", "RANKS", "PATH")]
    for r in rows:
        state = "committed" if r["committed"] else ("INVALID" if r["error"] else "uncommitted")
        table.append(
            (
                str(r["step"]),
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
            print(f"step {r['step']}: manifest rejected: {one_line(r['error'])}")
    print_committed_summary(rows)
    if versions:
        names = ", ".join(f"v{v}/" for v in versions)
        print(
            f"version folders {names} hold re-runs of the script; latest_checkpoint(dirpath) and "
            "ckpt_path='last' pick the newest step of the highest version that holds an intact checkpoint"
        )
    return 0


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


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify``: re-read generations (or accelerate's folders) and check sizes and checksums; 1 when any failed."""
    folders = _accelerate_folders(args)
    if folders is not None:
        from lightning_async_ckpt.tools.folder_commands import verify_folders

        return verify_folders(args, folders)
    store = open_store(args)
    listing = store.scan(include_uncommitted=True)
    _print_skipped(listing.skipped, to_stderr=args.json)
    gens = {g.step: g for g in listing.generations}
    skipped = []
    if args.step:
        missing = [s for s in args.step if s not in gens]
        if missing:
            steps = ", ".join(str(s) for s in sorted(gens)) or "none"
            raise UsageError(f"no generation for step(s) {missing} at {args.uri} (steps there: {steps})")
        targets = list(dict.fromkeys(args.step))
    else:
        targets = [s for s, g in sorted(gens.items()) if g.committed or g.error]
        skipped = [s for s, g in sorted(gens.items()) if not g.committed and not g.error]
        if not targets:
            raise UsageError(
                f"no committed generations at {args.uri}"
                + (f" (only uncommitted leftovers: {skipped})" if skipped else "; check the path")
            )
    results = [store.verify(step) for step in targets]
    # A committed generation whose manifest is gone now was retired by a running writer while it was read: not damage.
    removed = {r.step for r in results if not r.ok and gens[r.step].committed and _gone(store, r.step)}
    results = [r for r in results if r.step not in removed]
    failed = [r for r in results if not r.ok]
    if args.json:
        body = [
            {
                "step": r.step,
                "ok": r.ok,
                "problems": list(r.problems),
                "bytes": gens[r.step].manifest.total_bytes if gens[r.step].manifest else None,
                "ranks": _rank_bytes(gens[r.step].manifest),
            }
            for r in results
        ]
        entries = [{"name": e.name, "reason": e.reason} for e in listing.skipped]
        print(
            json.dumps(
                {
                    "ok": not failed,
                    "results": body,
                    "skipped_uncommitted": skipped,
                    "skipped_entries": entries,
                    "removed_while_verified": sorted(removed),
                },
                indent=1,
            )
        )
    else:
        for r in results:
            g = gens[r.step]
            if r.ok and g.manifest is not None:
                ranks = _rank_bytes(g.manifest)
                by = f", {len(ranks)} ranks" if ranks else ""
                size = f"{len(g.manifest.objects)} objects, {fmt_bytes(g.manifest.total_bytes)}{by}"
                print(f"step {r.step}: OK ({size}) {_on_disk(store, g)}")
            else:
                print(f"step {r.step}: FAILED ({_on_disk(store, g)})")
                for problem in r.problems:
                    print(f"  {one_line(_problem_on_disk(store, g, problem))}")
        for step in sorted(removed):
            print(f"step {step}: removed while it was verified (a writer's retention): not checked")
        if skipped:
            print(f"skipped uncommitted (no manifest; in progress or a crashed write): steps {skipped}")
        print(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    if failed:
        print(f"{PROG} verify: {len(failed)} generation(s) failed: steps {[r.step for r in failed]}", file=sys.stderr)
        return 1
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """``gc``: delete old generations, keeping the newest ``--keep-last`` committed ones and the ``--keep-best``
    best ones by the score their manifests record (the callback's ``best_model_path`` and its top k)."""
    if args.keep_last < 1:
        raise ConfigError(f"--keep-last must be >= 1 (the newest committed generation is kept), got {args.keep_last}")
    if args.keep_best < 0:
        raise ConfigError(f"--keep-best must be >= 0 (0 lets gc remove the best generations), got {args.keep_best}")
    if _accelerate_folders(args) is not None:
        raise UsageError(
            f"{args.uri} holds accelerate checkpoint folders, not step-* generations: accelerate owns their "
            "retention (ProjectConfiguration(total_limit=K)); `ls` and `verify` read them"
        )
    store = open_store(args, run_id=args.run_id)
    listing = store.scan(include_uncommitted=True)
    _print_skipped(listing.skipped, to_stderr=False)  # never opened, never removed: named
    gens = listing.generations
    runs = sorted({g.run_id for g in gens if g.committed and g.run_id})
    if args.run_id is None and not args.all_runs and len(runs) > 1:
        raise UsageError(
            f"{args.uri} holds generations of {len(runs)} runs ({', '.join(runs)}); pass --all-runs to keep the "
            "newest --keep-last across all of them, or --run-id ID to remove only that run's old generations"
        )
    if not gens:
        print(f"no generations at {args.uri}; nothing to do", file=sys.stderr)
    elif args.run_id is not None and args.run_id not in runs:
        print(f"note: no committed generation of run {args.run_id!r} here (runs: {runs})", file=sys.stderr)
    best, monitor = _best_k(gens, args.keep_best)
    # Without --run-id the CLI is not a run: it acts for the whole folder (one run, or --all-runs).
    report = store.retain(
        args.keep_last,
        all_runs=args.run_id is None,
        dry_run=args.dry_run,
        protect=frozenset(best),
        generations=gens,  # each manifest read once, not listed and read again
    )
    swept = store.upload_sweeper.last if not args.dry_run else None
    for upload in swept.aborted if swept is not None else []:
        print(f"aborted the open multipart upload of {upload.key} (step {upload.step}): no live writer owns it")
    for upload, why in swept.kept if swept is not None else []:
        print(f"kept the open multipart upload of {upload.key} (step {upload.step}): {why}")
    by_step = {g.step: g for g in gens}
    reasons = {r.step: r.reason for r in report.plan.remove}
    verb = "would remove" if args.dry_run else "removed"
    for step in report.removed:
        g = by_step.get(step)
        kind = "committed" if g is not None and g.committed else "uncommitted leftover"
        size = f", {fmt_bytes(g.manifest.total_bytes)}" if g is not None and g.manifest else ""
        print(f"{verb} step {step} ({kind}{size}): {reasons.get(step, '')}")
    for refusal in report.refused:
        print(f"kept step {refusal.step}: {one_line(refusal.reason)}")
    kept = [g.step for g in gens if g.committed and g.step not in report.removed]
    print(f"{verb} {len(report.removed)} generation(s); committed steps kept: {kept}")
    if best:
        print(f"kept the best {len(best)} by {monitor} (--keep-best {args.keep_best}): steps {sorted(best)}")
    top, top_monitor = _best_k(gens, 1)
    if top and top[0] in report.removed:
        print(
            f"warning: {verb} step {top[0]}, the best generation by {top_monitor}: the callback's best_model_path "
            "(and ckpt_path='best') named it; --keep-best K (default 1) keeps the best K",
            file=sys.stderr,
        )
    if report.failed:
        for step, error in report.failed:
            print(f"{PROG} gc: could not remove step {step}: {one_line(error)}", file=sys.stderr)
        print(f"{PROG} gc: could not remove steps {[s for s, _ in report.failed]}; run gc again", file=sys.stderr)
        return 1
    return 0


def _gone(store: Any, step: int) -> bool:
    """Whether generation ``step`` has no manifest now (removed since it was listed)."""
    info = store.read_generation(step)
    return not info.committed and info.error is None and not info.unreadable


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


def _best_k(gens: list[Any], k: int) -> tuple[list[int], str | None]:
    """The ``k`` best committed generations by the score their manifests record (the callback's ``monitor``), best
    first, and that monitor; ``([], None)`` when no manifest records a score."""
    ranked = []
    for g in gens:
        body = (g.manifest.extra.get("model_checkpoint") or {}) if g.committed and g.manifest else {}
        if body.get("ranked") and body.get("score") is not None and body.get("monitor"):
            sign = -1.0 if body.get("mode") == "max" else 1.0
            ranked.append((sign * float(body["score"]), g.step, body["monitor"]))
    ranked.sort()  # ties: the older step first, as ModelCheckpoint keeps the first of equal scores
    return [step for _, step, _ in ranked[:k]], (ranked[0][2] if ranked else None)


def _accelerate_folders(args: argparse.Namespace) -> list[Any] | None:
    """Accelerate's checkpoint folders at ``args.uri``, or ``None`` when it is not such a layout (a store)."""
    from lightning_async_ckpt.accelerate.folders import accelerate_folders

    return accelerate_folders(args.uri, storage_options(args.storage_option))


def _print_skipped(skipped: list[Any], *, to_stderr: bool) -> None:
    """Name every folder entry the listing did not read as a generation (never skipped silently)."""
    for entry in skipped:
        print(f"skipped {entry.name}: {entry.reason}", file=sys.stderr if to_stderr else sys.stdout)


def _check_store_path(store: Any, uri: str) -> None:
    """An empty listing is fine for an existing (empty) store folder; a missing path or a file is a usage error."""
    if not store.fs.exists(store.root):
        raise UsageError(f"no such store: {uri} does not exist (check the path, or the bucket and prefix)")
    if not store.fs.isdir(store.root):
        raise UsageError(f"{uri} is a file, not a store folder (pass the folder that holds step-* generations)")
    nested = subfolders_holding_checkpoints(store.fs, store.root)
    if nested:
        raise UsageError(f"no generations directly at {uri}; these subfolders hold some: {', '.join(nested[:5])}")


def open_store(args: argparse.Namespace, run_id: str | None = None, uri: str | None = None) -> Any:
    """The store named by ``args.uri`` (or ``uri``) and ``args.storage_option``, opened read-mostly (no
    writability probe)."""
    from lightning_async_ckpt.storage.store import CheckpointStore

    options = storage_options(args.storage_option)
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
