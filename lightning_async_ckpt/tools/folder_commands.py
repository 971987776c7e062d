"""``ls`` and ``verify`` of accelerate checkpoint folders (``checkpoint_N`` or one ``save_state`` folder)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lightning_async_ckpt.accelerate.folders import verify_accelerate_folder
from lightning_async_ckpt.tools.fmt import fmt_age, fmt_bytes, one_line, print_table
from lightning_async_ckpt.tools.store_commands import PROG, UsageError, print_committed_summary, storage_options

__all__ = ["ls_folders", "verify_folders"]


def ls_folders(args: argparse.Namespace, folders: list[Any]) -> int:
    """Print one row per folder: name, step, state, size, objects, age, run."""
    now = time.time()
    rows = [
        {
            "folder": f.name,
            "step": f.step,
            "state": f.state,
            "committed": f.committed,
            "bytes": f.manifest.total_bytes if f.manifest else None,
            "objects": len(f.manifest.objects) if f.manifest else None,
            "run_id": f.manifest.run_id if f.manifest else None,
            "committed_at": f.manifest.committed_at if f.manifest else None,
            "age_s": (now - f.mtime) if f.mtime else None,
            "path": f.url,
            "error": f.error,
        }
        for f in folders
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [("FOLDER", "STEP", "STATE", "SIZE", "OBJECTS", "AGE", "RUN")]
    for r in rows:
        table.append(
            (
                r["folder"],
                "-" if r["step"] is None else str(r["step"]),
                _state_label(r["state"]),
                fmt_bytes(r["bytes"]),
                "-" if r["objects"] is None else str(r["objects"]),
                fmt_age(r["age_s"]),
                r["run_id"] or "-",
            )
        )
    print_table(table)
    for r in rows:
        if r["error"]:
            print(f"{r['folder']}: manifest rejected: {one_line(r['error'])}")
    print_committed_summary(rows)
    if any(r["state"] == "foreign" for r in rows):
        print("foreign: accelerate files without a manifest (not written through lightning_async_ckpt); unverifiable")
    return 0


def verify_folders(args: argparse.Namespace, folders: list[Any]) -> int:
    """Re-read every committed (or ``--step``-selected) folder's objects; 1 when any is damaged."""
    options = storage_options(args.storage_option)
    if args.step:
        steps = {f.step for f in folders if f.step is not None}
        missing = [s for s in args.step if s not in steps]
        if missing:
            there = ", ".join(str(s) for s in sorted(steps)) or "none"
            raise UsageError(f"no committed folder for step(s) {missing} at {args.uri} (steps there: {there})")
        targets = [f for f in folders if f.step in set(args.step)]
        skipped = []
    else:
        targets = [f for f in folders if f.state in ("committed", "invalid")]
        skipped = [f for f in folders if f.state not in ("committed", "invalid")]
        if not targets:
            names = ", ".join(f"{f.name} ({f.state})" for f in skipped)
            raise UsageError(f"no committed checkpoint folder at {args.uri}" + (f": only {names}" if names else ""))
    results = [(f, verify_accelerate_folder(f, options)) for f in targets]
    failed = [f for f, problems in results if problems]
    if args.json:
        body = [
            {
                "folder": f.name,
                "step": f.step,
                "ok": not problems,
                "problems": problems,
                "bytes": f.manifest.total_bytes if f.manifest else None,
            }
            for f, problems in results
        ]
        print(json.dumps({"ok": not failed, "results": body, "skipped": [f.name for f in skipped]}, indent=1))
    else:
        for f, problems in results:
            if not problems and f.manifest is not None:
                size = fmt_bytes(f.manifest.total_bytes)
                print(f"{f.name} (step {f.step}): OK ({len(f.manifest.objects)} objects, {size})")
            else:
                print(f"{f.name}{'' if f.step is None else f' (step {f.step})'}: FAILED")
                for problem in problems:
                    print(f"  {one_line(problem)}")
        for f in skipped:
            print(f"skipped {f.name}: {_state_label(f.state)}")
        print(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    if failed:
        print(f"{PROG} verify: {len(failed)} folder(s) failed: {[f.name for f in failed]}", file=sys.stderr)
        return 1
    return 0


def _state_label(state: str) -> str:
    return "INVALID" if state == "invalid" else state  # upper case like the store listing's rejected manifests
