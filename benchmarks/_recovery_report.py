"""The tables of ``bench recovery`` (``_bench_recovery.py``): restore and commit per store, the peer restore, goodput
per mode beside the recovery model's prediction (``tools/recovery_model.py``), and the ratios."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

GOODPUT_MODES = ("model_checkpoint", "one_tier", "two_tiers")


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "–"


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    """The tables: restore per store, commit latency per store, goodput per mode (with the model's prediction)."""
    from lightning_async_ckpt.tools.recovery_model import RecoveryInputs, plan_recovery

    restore, commit, first = result["restore"], result["commit_s"], result.get("commit_first_s", {})
    names = {"local": "local tier (this disk)", "moto": "durable tier, moto S3 (loopback)"}
    names["faulty"] = f"durable stand-in, `faulty://` capped at {args.remote_mbps:g} MB/s"
    lines = [
        f"Machine: {result['machine']}. State: {result['state_mb']:.0f} MB (model + Adam). Median (min-max) of "
        f"{args.repeats} interleaved repeats.",
        "",
        "| store | process start → first step s | lookup + load + first step s | save → committed s | "
        "first save of a new checkpointer s |",
        "|---|---|---|---|---|",
    ]
    for tier, runs in restore.items():
        cold = f"{first[tier]:.2f}" if tier in first else "–"
        lines.append(
            f"| {names[tier]} | {_med([r['total_s'] for r in runs])} | {_med([r['restore_s'] for r in runs])} | "
            f"{_med(commit.get(tier, []))} | {cold} |"
        )
    ratios = []
    for tier in ("moto", "faulty"):
        if "local" in restore and tier in restore:
            loc = statistics.median(r["restore_s"] for r in restore["local"])
            rem = statistics.median(r["restore_s"] for r in restore[tier])
            tot = statistics.median(r["total_s"] for r in restore["local"]) / statistics.median(
                r["total_s"] for r in restore[tier]
            )
            com = statistics.median(commit["local"]) / statistics.median(commit[tier])
            ratios.append(
                f"local / {tier}: restore {loc / rem:.2f}x (from process start {tot:.2f}x), commit {com:.2f}x"
            )
    if ratios:
        lines += ["", "Ratios (medians): " + "; ".join(ratios) + "."]
    peer = result.get("peer")
    if peer:
        lines += _peer_lines(peer)
    if result.get("goodput"):
        forked = [t for g in result["goodput"] for t in g.get("startup_s", [])]
        startup = statistics.median(forked or [r["startup_s"] for runs in restore.values() for r in runs])
        b = result["state_mb"] * 1e6
        w_l = b / statistics.median(commit["local"]) if "local" in commit else 1e12
        w_d = b / statistics.median(commit["moto"]) if "moto" in commit else 1e12
        model: dict[str, Any] = {}
        if args.step_s > 0:  # the model needs intervals of training time
            predicted = plan_recovery(
                RecoveryInputs(
                    state_bytes=b,
                    local_bandwidth=w_l,
                    durable_bandwidth=w_d,
                    local_every_s=args.local_every * args.step_s,
                    durable_every_s=args.every * args.step_s,
                    preempt_every_s=args.preempt_every if args.preempt_every > 0 else 1e18,
                    startup_s=startup,
                )
            )
            model = {m: f"{100 * p.goodput:.1f}%" for m, p in zip(GOODPUT_MODES, predicted, strict=True)}
        lines += [
            "",
            f"Goodput: {args.total_steps} steps x {args.step_s:g} s, durable every {args.every} steps, local every "
            f"{args.local_every}, SIGKILL every {args.preempt_every:g} s of wall time (same node: the local folder "
            f"survives); predicted with the restarts' median start-up before the lookup ({startup:.1f} s) and bandwidths "
            "from the commit latencies above.",
            "",
            "| mode (repeat) | wall s | goodput (measured) | goodput (model) | preemptions | steps lost | "
            "restart → first step s |",
            "|---|---|---|---|---|---|---|",
        ]
        for g in sorted(result["goodput"], key=lambda g: (GOODPUT_MODES.index(g["mode"]), g["repeat"])):
            if g.get("error"):
                lines.append(
                    f"| {g['mode']} ({g['repeat']}) | FAILED after {g['preemptions']} preemptions: {g['error']} |"
                )
                continue
            lines.append(
                f"| {g['mode']} ({g['repeat']}) | {g['wall_s']:.1f} | {100 * g['goodput']:.1f}% | {model.get(g['mode'], '–')} | "
                f"{g['preemptions']} | {g['lost_steps']} | {_med(g['restore_s'])} |"
            )
        by = {(g["mode"], g["repeat"]): g["goodput"] for g in result["goodput"] if not g.get("error")}
        for other in ("one_tier", "model_checkpoint"):
            pairs = [(by[("two_tiers", r)], by[(other, r)]) for m, r in by if m == other and ("two_tiers", r) in by]
            if pairs:
                per = ", ".join(f"{a / b:.2f}x" if b > 0 else "–" for a, b in pairs)
                lines.append(f"\nGoodput two_tiers / {other}, per repeat: {per}.")
    return "\n".join(lines)


def _peer_lines(peer: dict[str, list[float]]) -> list[str]:
    rows = (
        ("local", "both local folders intact (local)"),
        ("peer", "rank 0's folder deleted (from a peer)"),
        ("durable", "both deleted (durable, moto S3)"),
    )
    lines = [
        "",
        "Two DDP ranks on CPU, each its own node with its own local folder, `replicas=1`, restarted with "
        '`ckpt_path="last"` (the ranks agree on a step; a folder that lacks it is filled from a peer):',
        "",
        "| restart with | process start → first step (both ranks) s | fit start → first step s | "
        "lookup + agreement + fetch + load + first step s |",
        "|---|---|---|---|",
    ]
    for key, label in rows:
        lines.append(
            f"| {label} | {_med(peer[key])} | {_med(peer.get(f'{key} fit', []))} | "
            f"{_med(peer.get(f'{key} lookup', []))} |"
        )
    ratios = []
    for column, suffix in (
        ("from the lookup on", " lookup"),
        ("from the fit's start", " fit"),
        ("from process start", ""),
    ):
        durable = peer.get(f"durable{suffix}")
        if not durable or not peer.get(f"peer{suffix}"):
            continue
        d = statistics.median(durable)
        ratios.append(
            f"{column}: peer / durable {statistics.median(peer[f'peer{suffix}']) / d:.2f}x, local / durable "
            f"{statistics.median(peer[f'local{suffix}']) / d:.2f}x"
        )
    return [*lines, "", "Ratios (medians): " + "; ".join(ratios) + "."]
