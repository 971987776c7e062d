"""The ``export`` command: a committed generation's model weights as safetensors, committed as its own generation."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_async_ckpt.core.export import EXPORT_FORMAT, export_location, export_safetensors
from lightning_async_ckpt.tools.plan_commands import parse_size
from lightning_async_ckpt.tools.store_commands import UsageError, open_store, storage_options

__all__ = ["add_export_parser", "cmd_export"]


def add_export_parser(sub: Any) -> None:
    """Add ``export`` to the command line's subparsers."""
    p = sub.add_parser(
        "export",
        help="write a committed generation's model weights as safetensors, committed as its own generation",
    )
    p.add_argument("uri", help="the checkpoint store (a local path, s3://bucket/prefix, ...)")
    p.add_argument("step", help="the committed step to export, or 'latest'")
    p.add_argument("--format", required=True, choices=[EXPORT_FORMAT], help="the export format")
    p.add_argument("--out", metavar="URI", help="where the export is committed (default: URI/exports/safetensors)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], help="cast floating weights")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 << 30,
        metavar="B",
        help="bytes per file (5GB, 500MiB); above it: shards and model.safetensors.index.json (default 5GiB)",
    )
    p.add_argument("--model-key", metavar="KEY", help="the entry holding the model's state dict (default: auto)")
    p.add_argument("--strip-prefix", metavar="P", help="remove P from every tensor name (e.g. 'model.')")
    p.add_argument(
        "--trust-pickled-objects",
        action="store_true",
        help="load with torch.load(weights_only=False): only when every writer of the store is trusted",
    )
    p.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE", help="fsspec option (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="print the export's manifest summary as JSON")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``export``: 0 once the export is committed (or was already); 2 on bad input."""
    store = open_store(args)
    if args.step == "latest":
        info = store.latest()
        if info is None:
            raise UsageError(f"{args.uri} holds no committed generation to export")
        step = info.step
    elif args.step.isdigit():
        step = int(args.step)
    else:
        raise UsageError(f"STEP must be a committed step number or 'latest', got {args.step!r}")
    out = args.out or export_location(store.uri)
    manifest = export_safetensors(
        store,
        step,
        out,
        dtype=args.dtype,
        max_shard_size=int(args.max_shard_size),
        model_key=args.model_key,
        strip_prefix=args.strip_prefix,
        storage_options=storage_options(args.storage_option),
        trust_pickled_objects=args.trust_pickled_objects,
    )
    files = [o.name for o in manifest.objects]
    if args.json:
        print(json.dumps({"step": step, "uri": out, "files": files, "bytes": manifest.total_bytes}, indent=1))
    else:
        print(f"exported step {step} to {out}: {', '.join(files)} ({manifest.total_bytes} bytes, committed)")
    return 0
