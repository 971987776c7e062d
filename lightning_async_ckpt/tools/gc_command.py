"""The ``gc`` command: remove old generations of a store (or of both tiers), keeping the newest and the best.

:func:`run_gc` is what ``store_commands.cmd_gc`` runs; with ``--local-dirpath`` each tier is collected in turn
(``tier_commands``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.fmt import fmt_bytes, one_line
from lightning_async_ckpt.tools.store_commands import PROG, UsageError, accelerate_folders_at, open_store, print_skipped

__all__ = ["check_gc", "gc_store"]


def check_gc(args: argparse.Namespace) -> None:
    """``gc``'s arguments, checked before anything is removed.

    Raises:
        ConfigError: ``--keep-last`` or ``--keep-best`` out of range.
        UsageError: The location holds accelerate's folders (accelerate owns their retention).
    """
    if args.keep_last < 1:
        raise ConfigError(f"--keep-last must be >= 1 (the newest committed generation is kept), got {args.keep_last}")
    if args.keep_best < 0:
        raise ConfigError(f"--keep-best must be >= 0 (0 lets gc remove the best generations), got {args.keep_best}")
    if accelerate_folders_at(args) is not None:
        raise UsageError(
            f"{args.uri} holds accelerate checkpoint folders, not step-* generations: accelerate owns their "
            "retention (ProjectConfiguration(total_limit=K)); `ls` and `verify` read them"
        )


def gc_store(args: argparse.Namespace, uri: str, *, local: bool = False, protect: frozenset[int] = frozenset()) -> int:
    """``gc`` of one store (``args`` as parsed and checked by :func:`cmd_gc`); ``local``: a node-local tier, opened
    without the storage options; ``protect``: steps never removed (beside ``--keep-last`` and ``--keep-best``).
    Returns the exit status."""
    store = open_store(args, run_id=args.run_id, uri=uri, local=local)
    listing = store.scan(include_uncommitted=True)
    print_skipped(listing.skipped, to_stderr=False)  # never opened, never removed: named
    gens = listing.generations
    runs = sorted({g.run_id for g in gens if g.committed and g.run_id})
    if args.run_id is None and not args.all_runs and len(runs) > 1:
        raise UsageError(
            f"{uri} holds generations of {len(runs)} runs ({', '.join(runs)}); pass --all-runs to keep the "
            "newest --keep-last across all of them, or --run-id ID to remove only that run's old generations"
        )
    if not gens:
        print(f"no generations at {uri}; nothing to do", file=sys.stderr)
    elif args.run_id is not None and args.run_id not in runs:
        print(f"note: no committed generation of run {args.run_id!r} here (runs: {runs})", file=sys.stderr)
    best, monitor = _best_k(gens, args.keep_best)
    # Without --run-id the CLI is not a run: it acts for the whole folder (one run, or --all-runs).
    report = store.retain(
        args.keep_last,
        all_runs=args.run_id is None,
        dry_run=args.dry_run,
        protect=frozenset(best) | protect,
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
