"""Where the time of one local-tier commit goes: ``save`` -> committed future, copy at the cut, ~100 MB, a folder.

The same save the recovery bench's commit part times (``AsyncCheckpointer(CheckpointStore(folder, direct_io=direct_io), keep_last=1)``,
``save(step, state, defer=False).committed.result()``), with timers wrapped around the library's steps for the
duration of the run: the cut (capture + copy), the hand-off to the upload thread, ``begin`` (manifest check, the
step claim, the lease, clearing leftovers, the multipart sweep), ``torch.save`` through the I/O pump, the checksum,
the copies into the ``O_DIRECT`` buffers and the disk writes, every ``fsync`` (files and folders), the commit's
checks, listings and manifest, and what follows the manifest until the future resolves. Timers on different threads
overlap, so the parts do not add up to the total; the timeline (wall-clock marks) does.

Prints one table per round and the medians. Asserts nothing. Other processes on the machine change the figures:
the load average is printed with them.

Usage: python benchmarks/profile_local_commit.py [--dir /tmp] [--state-mb 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

_TOTALS: dict[str, float] = collections.defaultdict(float)
_COUNTS: dict[str, int] = collections.defaultdict(int)
_MARKS: dict[str, float] = {}
_LOCK = threading.Lock()


def _timed(name: str, fn: Any, mark: str | None = None) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        if mark:
            _MARKS.setdefault(f"{mark} start", t0)
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            with _LOCK:
                _TOTALS[name] += t1 - t0
                _COUNTS[name] += 1
            if mark:
                _MARKS[f"{mark} end"] = t1

    wrapper.__wrapped_timer__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(owner: Any, attr: str, name: str, mark: str | None = None) -> None:
    fn = getattr(owner, attr)
    if getattr(fn, "__wrapped_timer__", False):
        return
    if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
        setattr(owner, attr, staticmethod(_timed(name, fn, mark)))
    else:
        setattr(owner, attr, _timed(name, fn, mark))


def _patch_fsync() -> None:
    """``os.fsync`` timed apart for data objects (over 1 MiB) and for small files and folders."""
    fsync = os.fsync
    if getattr(fsync, "__wrapped_timer__", False):
        return

    def timed(fd: int) -> None:
        try:
            big = os.fstat(fd).st_size > (1 << 20)
        except OSError:
            big = False
        name = "fsync: data object" if big else "fsync: small files (claims, manifest) and folders"
        _timed(name, fsync)(fd)

    timed.__wrapped_timer__ = True  # type: ignore[attr-defined]
    os.fsync = timed


def instrument() -> None:
    """Wrap the library's steps with timers (this process only)."""
    from lightning_async_ckpt.core import completion, options, persist, stream_persister
    from lightning_async_ckpt.storage import backend, claims, direct, io, listing_check, store, writer
    from lightning_async_ckpt.storage.ledger import Ledger

    _patch_fsync()
    _patch(io, "fsync_dir", "fsync_dir (io: manifest/claim link)")
    _patch(backend, "fsync_dir", "fsync_dir (backend.sync_folder)")
    _patch(claims, "atomic_local_write", "lease renewal (atomic write)")
    _patch(io.Checksum, "update", "checksum (crc32c)")
    _patch(direct.DirectFile, "write", "copy into O_DIRECT buffers")
    _patch(direct.DirectFile, "flush", "O_DIRECT flush (wait for disk + tail)")
    _patch(direct.DirectFile, "close", "O_DIRECT close")
    _patch(backend.LocalBackend, "finish", "object finish (O_DIRECT flush wait + fsync)")
    _patch(backend.LocalBackend, "open_write", "object open (O_EXCL + O_DIRECT)")
    _patch(store.CheckpointStore, "begin", "begin (all)", mark="begin")
    _patch(store.CheckpointStore, "_holds_manifest", "begin: committed-manifest check")
    _patch(writer, "take_step_claim", "begin: step claim")
    _patch(claims.Lease, "create", "begin: lease create")
    _patch(writer, "clear_leftovers", "begin: clear leftovers (listing)")
    _patch(store.CheckpointStore, "invalidate_cache", "invalidate_cache")
    _patch(options.TorchSaveSerializer, "write", "torch.save through the pump", mark="serialize")
    _patch(persist.PumpedStream, "close", "pump close (wait for I/O thread)")
    _patch(writer.GenerationWriter, "commit", "commit (all)", mark="commit")
    _patch(writer.GenerationWriter, "_check_own", "commit: claim + identity check")
    _patch(writer.GenerationWriter, "_check_objects", "commit: listing checks (x2)")
    _patch(listing_check, "check_listed", "commit: check_listed")
    _patch(backend.LocalBackend, "create_exclusive", "commit: manifest create_exclusive")
    _patch(backend.LocalBackend, "sync_folder", "sync_folder (root/generation)")
    _patch(writer.GenerationWriter, "_release_claim", "commit: release step claim")
    _patch(claims.Lease, "release", "lease release")
    _patch(Ledger, "committed", "commit: ledger")
    _patch(writer, "_versions", "commit: package versions")
    _patch(stream_persister.StreamPersister, "persist", "persist (all)", mark="persist")
    _patch(completion.Completion, "_retain", "retention (after the future)", mark="retain")


def _state(layers: int, width: int) -> dict[str, Any]:
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).pow(2).mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def one_round(ckpt: Any, state: Any, step: int) -> dict[str, float]:
    """One save by ``ckpt``; the timers' totals and the timeline, in seconds."""
    _TOTALS.clear()
    _COUNTS.clear()
    _MARKS.clear()
    t0 = time.perf_counter()
    handle = ckpt.save(step, state, defer=False)
    t_cut = time.perf_counter()
    handle.committed.result(timeout=600)
    t_done = time.perf_counter()
    record = handle.record
    ckpt.drain()
    # Retention runs on the upload thread after the future resolved (drain does not wait for it): let it end, so
    # that the next round's save does not queue behind it.
    ckpt.upload_worker.submit(lambda: None).result(timeout=600)
    out = {"total: save -> committed": t_done - t0, "cut (save call, copy at the cut)": t_cut - t0}
    out["record: staging_s"] = record.staging_s
    out["record: upload_s"] = record.upload_s
    out["record: commit_s"] = record.commit_s
    for name, value in _TOTALS.items():
        out[f"{name} (n={_COUNTS[name]})"] = value
    marks = {k: v - t0 for k, v in _MARKS.items()}
    for a, b, label in (
        ("", "persist start", "timeline: save -> persist starts (cut + staging + hand-off)"),
        ("persist start", "begin start", "timeline: persist start -> begin"),
        ("begin end", "serialize start", "timeline: begin end -> torch.save starts"),
        ("serialize end", "commit start", "timeline: torch.save end -> commit starts"),
        ("commit end", "persist end", "timeline: commit end -> persist returns"),
    ):
        if b in marks and (not a or a in marks):
            out[label] = marks[b] - (marks[a] if a else 0.0)
    if "persist end" in marks:
        out["timeline: persist returns -> future resolved"] = (t_done - t0) - marks["persist end"]
    return out


def _checkpointer(folder: str, direct_io: bool) -> Any:
    from lightning_async_ckpt import AsyncCheckpointer
    from lightning_async_ckpt.storage.store import CheckpointStore

    return AsyncCheckpointer(CheckpointStore(folder, direct_io=direct_io), keep_last=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="parent of the scratch folder (default: the system temp dir)")
    p.add_argument("--state-mb", type=float, default=100.0)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-instrument", action="store_true", help="time the total only (no wrappers)")
    p.add_argument("--buffered", action="store_true", help="CheckpointStore(direct_io=False): page-cache writes")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="a new checkpointer per save (what `bench recovery` did before: pool and threads created each time); "
        "default: one checkpointer, a warm-up save, then one save per round, as training uses it",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    layers = max(1, int(args.state_mb * 1e6 / 3 / 4 / (args.width * args.width + args.width)))
    state = _state(layers, args.width)
    if not args.no_instrument:
        instrument()
    rows: dict[str, list[float]] = collections.defaultdict(list)
    scratch = tempfile.mkdtemp(prefix="lac-profile-commit-", dir=args.dir)
    load0 = os.getloadavg()
    try:
        ckpt = None
        for r in range(args.rounds + 1):  # round 0 warms the pools, caches and imports: not counted
            if ckpt is None or args.fresh:
                if ckpt is not None:
                    ckpt.close()
                ckpt = _checkpointer(os.path.join(scratch, f"r{r}"), not args.buffered)
            result = one_round(ckpt, state, r + 1)
            if r:
                for k, v in result.items():
                    rows[k].append(v)
        ckpt.close()
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    mb = 3 * 4 * layers * (args.width * args.width + args.width) / 1e6
    print(
        f"# {mb:.0f} MB, {args.rounds} rounds (+1 warm-up) in {args.dir or tempfile.gettempdir()}, "
        f"{'a new checkpointer per save' if args.fresh else 'one checkpointer'}"
        f"{', buffered writes' if args.buffered else ''}; load average "
        f"{load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {os.cpu_count()} cores"
    )
    print("| part | median s | min-max s |\n|---|---|---|")
    for k in sorted(rows, key=lambda k: (not k.startswith("total"), not k.startswith("timeline"), k)):
        v = rows[k]
        print(f"| {k} | {statistics.median(v):.4f} | {min(v):.4f}-{max(v):.4f} |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(_HERE))
    raise SystemExit(main())
