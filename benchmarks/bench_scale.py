"""S3 requests of a save, a lookup and a resume at 10 / 1,000 / 10,000 generations and 2-16 ranks, measured
against ``tools/request_model.py``'s prediction (issue 27 item 7).

A moto S3 server runs in this process on loopback and every request it answers is counted from its request log
(exact, by kind). Two parts:

* **Generations** (one writer): the folder holds ``G`` committed generations of another run (``run_id="filler"``).
  The three newest are real commits through the library's writer (``store.begin`` ... ``commit``) of a 16-byte
  object; the older ``G - 3`` are made in bulk: the same object and a manifest built with the library's
  ``Manifest`` (size and checksum of the object), all written in one concurrent ``fs.pipe`` (``--fill http``: about
  45 s per 1,000 generations on a loaded 2-core machine) or put straight into the moto server's bucket
  (``--fill direct``). Each bulk generation is what a commit leaves (data object + ``manifest.json``, no claims); a
  sample of them is checked with ``store.verify`` before anything is counted. Counted: ``latest_checkpoint(dirpath)``,
  ``store.latest()`` (what a resume runs: the newest generation found and every object re-read), and a later save of
  a second run with ``keep_last=2`` (its first two saves build the store's ledger).
* **Ranks** (sharded): ``N`` gloo processes on CPU, each with a 16-float FSDP2 ``fully_shard``-ed ``Linear(4, 4)``
  and Adam, save through ``ShardedCheckpointer(s3://..., keep_last=2)``; the third save is counted (every rank's
  requests, from the moment the server went quiet after the second save's background retention until the
  checkpointer closed), then the resume the docs show: every rank calls ``CheckpointStore(uri).latest()``.

Run: ``python benchmarks/bench_scale.py [--generations 10,1000,10000] [--ranks 2,4,8,16] [--json FILE]``.
Prints two markdown tables (measured vs predicted, by kind).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

KINDS = ("LIST", "GET", "HEAD", "PUT", "POST", "DELETE")
_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[0-9.]+" \d{3}')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _bench_requests() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_requests

    return bench_requests


class _Log(logging.Handler):
    """Every request line of the moto server (werkzeug's log) while installed, as ``(kind, method, target)``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.requests: list[tuple[str, str, str]] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        match = _LINE.search(_ANSI.sub("", record.getMessage()))
        if match:
            method, target = match["method"], match["target"]
            listing = method == "GET" and ("list-type=" in target or "delimiter=" in target)
            with self._guard:
                self.requests.append(("LIST" if listing else method, method, target))


def quiesce(period_s: float = 2.0, limit_s: float = 120.0) -> None:
    """Wait until the server answered no request for ``period_s`` (a previous save's background retention ended)."""
    logger = logging.getLogger("werkzeug")
    logger.setLevel(logging.INFO)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        log = _Log()
        logger.addHandler(log)
        try:
            time.sleep(period_s)
        finally:
            logger.removeHandler(log)
        if not log.requests:
            return
    raise SystemExit(f"the server did not go quiet within {limit_s} s")


def count(fn: Any, trace: bool = False) -> Counter[str]:
    """Requests by kind that the server answered while ``fn()`` ran (``trace``: print each one)."""
    logger = logging.getLogger("werkzeug")
    log = _Log()
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(log)
    if trace:
        for kind, method, target in log.requests:
            print(f"#   {kind:6} {method:6} {target[:160]}", flush=True)
    return Counter(kind for kind, _, _ in log.requests)


def fmt_counts(kinds: Counter[str] | dict[str, int]) -> str:
    """``**24** (9 LIST, 6 GET, ...)``: the total, then each kind that occurred."""
    parts = ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds.get(k))
    return f"**{sum(kinds.values()):,}** ({parts})"


def fill(store: Any, count: int, real: int = 3, direct: bool = False) -> None:
    """``count`` committed generations of run ``filler``: the newest ``real`` through the writer, the rest in bulk
    (``direct``: put into the in-process moto server's backend, else one concurrent ``fs.pipe`` over HTTP)."""
    from lightning_async_ckpt.storage.io import Checksum
    from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry

    data = b"x" * 16
    digest = Checksum(store.checksum)
    digest.update(data)
    entry = ObjectEntry(name="checkpoint.ckpt", size=len(data), checksum=digest.hexdigest())
    bulk = max(0, count - real)
    files = {}
    for step in range(bulk):
        manifest = Manifest(step=step, run_id="filler", objects=(entry,), committed_at=1000.0 + step)
        files[f"{store.generation_path(step)}/checkpoint.ckpt"] = data
        files[f"{store.generation_path(step)}/manifest.json"] = manifest.to_json()
    if files and direct:
        # Into the in-process moto server's bucket, as its PUT handler would store them (no HTTP round trips).
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        for path, value in files.items():
            bucket, key = path.split("/", 1)
            backend.put_object(bucket, key, value.encode() if isinstance(value, str) else value)
    elif files:
        store.fs.pipe(files)
    store.invalidate_cache()
    for step in range(bulk, count):
        writer = store.begin(step)
        writer.write_bytes("checkpoint.ckpt", data)
        writer.commit()
    for step in sorted({0, bulk // 2, max(0, bulk - 1)} if bulk else ()):
        if not store.verify(step).ok:
            raise SystemExit(f"bulk generation {step} does not verify")


def _server() -> tuple[Any, dict[str, Any]]:
    os.environ.update(_ENV)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}


def _bucket(options: dict[str, Any]) -> str:
    import s3fs

    bucket = f"scale-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
    return bucket


def measure_generations(sizes: list[int], options: dict[str, Any], direct: bool = False) -> list[dict[str, Any]]:
    """Counts and predictions of the one-writer operations for each number of generations."""
    import s3fs

    from lightning_async_ckpt import latest_checkpoint
    from lightning_async_ckpt.storage.store import CheckpointStore
    from lightning_async_ckpt.tools.request_model import predict_latest_checkpoint, predict_resume, predict_save

    br = _bench_requests()
    rows = []
    for g in sizes:
        uri = f"s3://{_bucket(options)}/ckpt"
        t0 = time.perf_counter()
        fill(CheckpointStore(uri, options, run_id="filler"), g, direct=direct)
        fill_s = time.perf_counter() - t0
        s3fs.S3FileSystem.clear_instance_cache()
        row: dict[str, Any] = {"generations": g, "fill_s": fill_s}
        kinds = count(functools.partial(latest_checkpoint, uri, options))
        row["latest_checkpoint"] = (dict(kinds), predict_latest_checkpoint(objects=1, generations=g).requests)
        kinds = count(CheckpointStore(uri, options, check_writable=False).latest)
        row["resume"] = (dict(kinds), predict_resume(objects=1, generations=g).requests)
        store = CheckpointStore(uri, options, run_id="this-run")
        br._save(store, g)
        br._save(store, g + 1)
        kinds = count(functools.partial(br._save, store, g + 2))
        # Retention listed the G filler generations and this run's three.
        row["save"] = (dict(kinds), predict_save(objects=1, generations=g + 3, keep_last=2).requests)
        rows.append(row)
        print(f"# G={g}: filled in {fill_s:.1f}s; {row}", flush=True)
    return rows


# -- sharded -----------------------------------------------------------------------------------------------
def _rank(uri: str, options_json: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_async_ckpt.sharded import ShardedCheckpointer
    from lightning_async_ckpt.storage.store import CheckpointStore

    options = json.loads(options_json)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()

    def handshake(what: str) -> None:
        dist.barrier()
        if rank == 0:
            print(f"READY {what}", flush=True)
            sys.stdin.readline()
        dist.barrier()

    with ShardedCheckpointer(uri, storage_options=options, keep_last=2, timeout_s=600) as ckpt:
        for step in (1, 2, 3):
            if step == 3:
                handshake("save")
            msd, osd = get_state_dict(model, opt)
            ckpt.save(step, {"model": msd, "optim": osd}).result(timeout=600)
    # Closed: the third save's retention and clean-up are done before its counting window ends.
    handshake("resume")
    info = CheckpointStore(uri, options, check_writable=False).latest()
    assert info is not None and info.step == 3
    handshake("once")
    from lightning_async_ckpt.sharded.once import latest_once

    info = latest_once(CheckpointStore(uri, options, check_writable=False))  # rank 0 finds, every rank gets it
    assert info is not None and info.step == 3
    handshake("done")
    dist.destroy_process_group()


def measure_ranks(world_sizes: list[int], options: dict[str, Any], trace: bool = False) -> list[dict[str, Any]]:
    """Counts and predictions of one sharded save and the every-rank resume for each world size."""
    from lightning_async_ckpt.tools.request_model import predict_resume, predict_sharded_save

    rows = []
    for n in world_sizes:
        uri = f"s3://{_bucket(options)}/ckpt"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(n):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), RANK=str(rank))
            env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", **_ENV)
            argv = [sys.executable, os.path.abspath(__file__), "--rank", uri, json.dumps(options)]
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        lead = procs[0]
        t0 = time.perf_counter()
        counted: dict[str, dict[str, int]] = {}
        try:
            line = lead.stdout.readline()
            if line.strip() != "READY save":
                raise SystemExit(f"{n} ranks: expected READY save, got {line!r}")
            quiesce()  # the second save's retention runs after its commit, in the background
            kinds = count(functools.partial(_release_and_wait, lead, "resume"), trace)
            counted["save"] = dict(kinds)
            kinds = count(functools.partial(_release_and_wait, lead, "once"))
            counted["resume"] = dict(kinds)
            kinds = count(functools.partial(_release_and_wait, lead, "done"))
            counted["resume_once"] = dict(kinds)
            lead.stdin.write("\n")
            lead.stdin.flush()
            for p in procs:
                if p.wait(timeout=600):
                    raise SystemExit(f"{n} ranks: a rank exited {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        per_rank = predict_resume(objects=n + 1, generations=2).requests
        row = {
            "ranks": n,
            "wall_s": time.perf_counter() - t0,
            "save": (counted["save"], predict_sharded_save(ranks=n, generations=3, keep_last=2).requests),
            "resume": (counted["resume"], {k: v * n for k, v in per_rank.items()}),
            "resume_once": (counted["resume_once"], per_rank),  # rank 0 alone reads
        }
        rows.append(row)
        print(f"# N={n}: {row}", flush=True)
    return rows


def _release_and_wait(lead: subprocess.Popen, until: str) -> None:
    lead.stdin.write("\n")
    lead.stdin.flush()
    line = lead.stdout.readline()
    if line.strip() != f"READY {until}":
        raise SystemExit(f"expected READY {until}, got {line!r}")


def _cell(pair: tuple[dict[str, int], dict[str, int]]) -> str:
    measured, predicted = pair
    same = "=" if dict(Counter(measured)) == dict(Counter(predicted)) else "≠"
    return f"{fmt_counts(measured)} {same} {fmt_counts(predicted)}"


def markdown(gen_rows: list[dict[str, Any]], rank_rows: list[dict[str, Any]]) -> str:
    """Both tables: each cell is ``measured (= or ≠) predicted``."""
    out = []
    if gen_rows:
        out += [
            "| operation (one writer) | " + " | ".join(f"G = {r['generations']:,}" for r in gen_rows) + " |",
            "|---|" + "---|" * len(gen_rows),
        ]
        for key, name in (
            ("save", "a later save, `keep_last=2` (measured = / ≠ predicted)"),
            ("latest_checkpoint", "`latest_checkpoint(dirpath)`"),
            ("resume", "resume: `store.latest()` (newest found, its object re-read)"),
        ):
            out.append(f"| {name} | " + " | ".join(_cell(r[key]) for r in gen_rows) + " |")
    if rank_rows:
        out += [
            "",
            "| operation (sharded, all ranks) | " + " | ".join(f"N = {r['ranks']}" for r in rank_rows) + " |",
            "|---|" + "---|" * len(rank_rows),
        ]
        for key, name in (
            ("save", "a later sharded save, `keep_last=2`"),
            ("resume", "resume: every rank `store.latest()`"),
            ("resume_once", "resume once per job: every rank `latest_once(store)`"),
        ):
            out.append(f"| {name} | " + " | ".join(_cell(r[key]) for r in rank_rows) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Measure and print the tables; ``--json`` also writes every count."""
    parser = argparse.ArgumentParser(prog="bench_scale.py", description=__doc__.splitlines()[0])
    parser.add_argument("--generations", default="10,1000,10000", help="comma-separated G (empty: skip)")
    parser.add_argument("--ranks", default="2,4,8,16", help="comma-separated world sizes (empty: skip)")
    parser.add_argument("--json", default=None, help="write every count to this file")
    parser.add_argument("--trace", action="store_true", help="print every request of the sharded saves")
    parser.add_argument(
        "--fill",
        choices=("http", "direct"),
        default="http",
        help="how the older generations are made: one concurrent fs.pipe over HTTP (default), or put straight into "
        "the in-process moto backend (faster, no HTTP)",
    )
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.generations.split(",") if x.strip()]
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    import logging

    werkzeug = logging.getLogger("werkzeug")
    werkzeug.propagate = False
    werkzeug.addHandler(logging.NullHandler())  # else werkzeug installs its own handler printing every request
    server, options = _server()
    try:
        gen_rows = measure_generations(sizes, options, direct=args.fill == "direct")
        rank_rows = measure_ranks(worlds, options, args.trace)
    finally:
        server.stop()
    import botocore
    import fsspec
    import moto
    import torch

    versions = (
        f"{platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
        f"fsspec {fsspec.__version__}, botocore {botocore.__version__}, moto {moto.__version__}"
    )
    print(f"\n{versions}\n")
    print(markdown(gen_rows, rank_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "generations": gen_rows, "ranks": rank_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(main())
