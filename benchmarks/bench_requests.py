"""S3 request counts of finding the newest checkpoint and of one save with retention (issue 27).

Starts a moto S3 server on loopback, fills a bucket prefix with G tiny committed generations (written through
the library's ``Manifest``, in one batch) and counts every request the server answers (its request log) during:

- ``latest_checkpoint(dirpath)`` and ``CheckpointStore.latest()`` (the newest generation intact);
- one save with ``keep_last=2`` of another run in that folder: its first save (a new store) and a later one;
- a later save of ``OBJECTS`` objects (what the commit and retention check per object: one listing, no HEAD each).

Run: ``python benchmarks/bench_requests.py [G ...]`` (default 10 1000). Prints a markdown table.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time
import uuid
from collections import Counter
from typing import Any

OBJECTS = 20  # objects of the many-object save (one per rank of a sharded save)
_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[0-9.]+" \d{3}')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Requests(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.kinds: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        match = _LINE.search(_ANSI.sub("", record.getMessage()))
        if match:
            method, target = match["method"], match["target"]
            self.kinds["LIST" if method == "GET" and "list-type=" in target else method] += 1


def _count(fn: Any) -> tuple[Counter[str], float]:
    logger = logging.getLogger("werkzeug")
    handler = _Requests()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    start = time.perf_counter()
    try:
        fn()
    finally:
        logger.removeHandler(handler)
    return handler.kinds, time.perf_counter() - start


def _fill(store: Any, count: int) -> None:
    from lightning_async_ckpt.storage.io import Checksum
    from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry

    data = b"x" * 16
    digest = Checksum(store.checksum)
    digest.update(data)
    entry = ObjectEntry(name="checkpoint.ckpt", size=len(data), checksum=digest.hexdigest())
    files = {}
    for step in range(count):
        manifest = Manifest(step=step, run_id="filler", objects=(entry,), committed_at=1000.0 + step)
        files[f"{store.generation_path(step)}/checkpoint.ckpt"] = data
        files[f"{store.generation_path(step)}/manifest.json"] = manifest.to_json()
    store.fs.pipe(files)
    store.invalidate_cache()


def _save(store: Any, step: int, objects: int = 1) -> None:
    writer = store.begin(step)
    if objects == 1:
        writer.write_bytes("checkpoint.ckpt", b"y" * 16)
    for i in range(objects if objects > 1 else 0):
        writer.write_bytes(f"shard-{i:03d}.bin", b"y" * 16)  # one object per rank of a sharded save
    writer.commit()
    store.gc(2)


def _fmt(kinds: Counter[str]) -> str:
    parts = ", ".join(f"{kinds[k]} {k}" for k in ("LIST", "GET", "HEAD", "PUT", "POST", "DELETE") if kinds[k])
    return f"**{sum(kinds.values())}** ({parts})"


def main(sizes: list[int]) -> None:
    """Print the table for ``sizes`` generations."""
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import s3fs
    from moto.server import ThreadedMotoServer

    from lightning_async_ckpt import latest_checkpoint
    from lightning_async_ckpt.storage.store import CheckpointStore

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    rows: dict[str, list[str]] = {}
    try:
        for g in sizes:
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
            uri = f"s3://{bucket}/ckpt"
            _fill(CheckpointStore(uri, options, run_id="filler"), g)
            s3fs.S3FileSystem.clear_instance_cache()
            ops = {
                "`latest_checkpoint(dirpath)`": functools.partial(latest_checkpoint, uri, options),
                "`store.latest()`": CheckpointStore(uri, options, check_writable=False).latest,
            }
            for name, fn in ops.items():
                kinds, _ = _count(fn)
                rows.setdefault(name, []).append(_fmt(kinds))
            store = CheckpointStore(uri, options, run_id="this-run")
            kinds, _ = _count(functools.partial(_save, store, g))
            rows.setdefault("first save of a run, `keep_last=2`", []).append(_fmt(kinds))
            _save(store, g + 1)
            kinds, _ = _count(functools.partial(_save, store, g + 2))
            rows.setdefault("a later save, `keep_last=2`", []).append(_fmt(kinds))
            _save(store, g + 3, OBJECTS)
            kinds, _ = _count(functools.partial(_save, store, g + 4, OBJECTS))
            rows.setdefault(f"a later save of {OBJECTS} objects, `keep_last=2`", []).append(_fmt(kinds))
    finally:
        server.stop()
    print("| operation | " + " | ".join(f"G = {g:,}" for g in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [10, 1000])
