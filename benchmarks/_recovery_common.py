"""What the parts of ``bench recovery`` share: the environment, the event files, the stores, the moto S3 server.

The moto server runs in a process of its own (``python -m moto.server``), as a remote store would: hosted in the
benchmark's process (``ThreadedMotoServer``), its request handling took the GIL from the client it served and from
the local saves measured beside it, so the durable tier's figures included the server's Python.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def events(path: str) -> list[dict[str, Any]]:
    """The JSON lines a training process appended to ``path`` (none when it never started)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoProcess:
    """A moto S3 server in its own process on loopback; :meth:`stop` ends it.

    Args:
        log: File its output goes to.
        timeout_s: How long to wait for it to accept connections.

    Raises:
        RuntimeError: It exited or did not listen within ``timeout_s``.
    """

    def __init__(self, log: str, timeout_s: float = 120.0) -> None:
        self.port = free_port()
        env = dict(os.environ, **ENV)
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with open(log, "a") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the moto server exited with {self.proc.returncode}: {Path(log).read_text()[-2000:]}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the moto server did not listen on port {self.port} in {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.1)
        self.options = {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "testing", "secret": "testing"}

    def stop(self) -> None:
        """End the server (bounded)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def stores(folder: str, options: dict[str, Any], tag: str) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """The three stores of one part: a local folder, a fresh moto bucket, and ``slowfaulty://`` over a folder."""
    bucket = f"rec-{uuid.uuid4().hex[:10]}"
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
    return {
        "local": (os.path.join(folder, f"local-{tag}"), None),
        "moto": (f"s3://{bucket}/{tag}", options),
        "faulty": (f"slowfaulty://{os.path.join(folder, f'remote-{tag}')}", None),
    }
