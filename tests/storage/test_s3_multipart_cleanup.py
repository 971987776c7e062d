"""S3 multipart uploads left open by a killed writer are aborted by the next writer's ``begin``/``gc`` and by the
CLI's ``gc`` once no live attempt owns them; a live writer's upload is never aborted (moto server, real uploads).

The killed writer is a real process (``tests/helpers/interrupted_upload.py``) SIGKILLed with a multipart upload open.
Its lease would expire two to three minutes later; the tests rewrite its claims' ``expires`` into the past instead
of waiting (the state a restarted job finds once that time has passed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_async_ckpt.storage.claims import is_claim_name
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tools.cli import main
from tests.helpers.forked import start_script

Location = tuple[str, dict[str, Any]]
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "interrupted_upload.py"
BOUND_S = 120.0
BLOCK = 5 << 20


def _uploads(uri: str, options: dict[str, Any]) -> list[str]:
    """Keys of the open multipart uploads in the store's bucket."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    bucket = uri.removeprefix("s3://").split("/", 1)[0]
    return sorted(u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))


def _killed_mid_upload(location: Location, run_id: str, step: int) -> None:
    """Run a writer until its upload of ``step`` is open, then SIGKILL it."""
    uri, options = location
    args = [sys.executable, str(WORKER), uri, json.dumps(options), run_id, str(step)]
    # Forked from the session's zygote (torch, s3fs imported once): a separate process, SIGKILLed mid-upload.
    with start_script(args, cwd=REPO, stdin=True) as proc:
        assert proc.readline(timeout=BOUND_S) == "uploading\n", f"the writer never started its upload\n{proc.stderr}"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=BOUND_S) == -signal.SIGKILL
    assert len(_uploads(uri, options)) == 1  # left open by the kill


def _leases_expired(location: Location, step: int) -> None:
    """Move the expiry of every claim in generation ``step`` an hour into the past."""
    uri, options = location
    store = CheckpointStore(uri, options, check_writable=False)
    for path in store.fs.find(store.generation_path(step)):
        if is_claim_name(path.rsplit("/", 1)[-1]):
            body = json.loads(store.fs.cat_file(path))
            body["expires"] = time.time() - 3600
            store.fs.pipe_file(path, json.dumps(body).encode())
    store.invalidate_cache()


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", f"step {step}".encode())
    writer.commit()
    store.gc(1)


def test_the_next_writer_of_that_step_aborts_the_killed_upload(s3_uri: Location) -> None:
    uri, options = s3_uri
    _commit(CheckpointStore(uri, options, run_id="run"), 1)
    _killed_mid_upload(s3_uri, "run", 2)
    _leases_expired(s3_uri, 2)
    restarted = CheckpointStore(uri, options, run_id="run")
    _commit(restarted, 2)  # begin, commit, gc(keep_last=1)
    assert _uploads(uri, options) == []
    assert restarted.latest().step == 2


def test_a_writer_of_a_later_step_aborts_the_killed_upload(s3_uri: Location) -> None:
    uri, options = s3_uri
    _commit(CheckpointStore(uri, options, run_id="run"), 1)
    _killed_mid_upload(s3_uri, "run", 2)
    _leases_expired(s3_uri, 2)
    restarted = CheckpointStore(uri, options, run_id="run")
    _commit(restarted, 3)
    assert _uploads(uri, options) == []
    assert restarted.latest().step == 3


def test_the_operators_gc_aborts_the_killed_upload(s3_uri: Location, capsys: pytest.CaptureFixture) -> None:
    uri, options = s3_uri
    _commit(CheckpointStore(uri, options, run_id="run"), 1)
    _killed_mid_upload(s3_uri, "run", 2)
    _leases_expired(s3_uri, 2)
    flags = [f"--storage-option={key}={value}" for key, value in options.items()]
    assert main(["gc", uri, "--keep-last", "1", *flags]) == 0
    assert _uploads(uri, options) == []
    assert "aborted" in capsys.readouterr().out


def test_a_live_writers_upload_is_never_aborted(s3_uri: Location) -> None:
    uri, options = s3_uri
    live = CheckpointStore(uri, options, run_id="live", block_size=BLOCK)
    writer = live.begin(5)
    stream = writer.open("checkpoint.ckpt")
    stream.write(b"y" * (BLOCK + (1 << 20)))  # its multipart upload is open
    assert len(_uploads(uri, options)) == 1
    other = CheckpointStore(uri, options, run_id="other")
    _commit(other, 6)  # another writer's begin and gc
    flags = [f"--storage-option={key}={value}" for key, value in options.items()]
    assert main(["gc", uri, "--keep-last", "1", "--run-id", "other", *flags]) == 0
    assert len(_uploads(uri, options)) == 1  # still open: its writer's lease is live
    stream.close()
    writer.commit()
    assert live.verify(5).ok
