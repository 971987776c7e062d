"""Shared test fixtures: an S3 endpoint on loopback (moto), fresh buckets and memory roots, and a thread-leak guard.

Fixtures:
    s3_endpoint: Session-wide moto S3 server, a process of its own, on 127.0.0.1 (free port); dummy AWS credentials; URL.
    s3_uri: A fresh bucket per test: ``("s3://<bucket>/ckpt", storage_options)``.
    memory_uri: A unique ``memory://`` root per test, removed afterwards.
    no_leaked_threads (autouse): Fails a test that leaves a ``lightning_async_ckpt*`` thread running.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_async_ckpt.testing import register_faulty

pytest_plugins = ("pytester",)
register_faulty()  # the tests name faulty:// URLs; installing the package registers nothing

# Every thread the library starts is named with this prefix (style: "named threads make it one line").
THREAD_PREFIX = "lightning_async_ckpt"
# How long a test's leftover threads get, in total, to finish on their own before the test fails.
LEAK_JOIN_TIMEOUT_S = 5.0

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail the test if it leaves a library thread alive (after a bounded join, never a sleep)."""
    before = set(_our_threads())
    yield
    leaked = [t for t in _our_threads() if t not in before]
    deadline = time.monotonic() + LEAK_JOIN_TIMEOUT_S
    for thread in leaked:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = sorted(t.name for t in leaked if t.is_alive())
    if alive:
        pytest.fail(
            f"test leaked threads {alive} (still alive {LEAK_JOIN_TIMEOUT_S:.0f}s after it ended); "
            "close() or drain every checkpointer the test starts",
            pytrace=False,
        )


# Folders Lightning creates in the working directory when a test forgets its own dirpath / default_root_dir.
_CWD_ARTIFACTS = ("checkpoints", "lightning_logs")


@pytest.fixture(autouse=True)
def no_files_in_the_working_directory() -> Iterator[None]:
    """Fail a test that leaves Lightning's default output folders in the working directory (the checkout)."""
    cwd = Path.cwd()
    before = {name for name in _CWD_ARTIFACTS if (cwd / name).exists()}
    yield
    created = [name for name in _CWD_ARTIFACTS if name not in before and (cwd / name).exists()]
    for name in created:
        shutil.rmtree(cwd / name, ignore_errors=True)
    assert not created, f"the test wrote {created} into {cwd}: give its Trainer a dirpath / default_root_dir"


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start a moto S3 server on a free loopback port for the session; yield its URL.

    The server is a process of its own (``tests/helpers/moto_process.py``), so its requests do not wait for the
    GIL of the pytest process; it appends every request line to a log that ``tests/helpers/s3_requests.py`` reads
    (the log's path is in ``$LAC_TEST_MOTO_REQUEST_LOG``). Dummy credentials and region are set in the environment
    (also seen by subprocesses, the server included) so nothing can reach a real account.
    """
    pytest.importorskip("s3fs", reason="s3fs is needed for S3 tests")
    from tests.helpers.moto_process import LOG_ENV, MotoUnavailable, moto_server

    log = tmp_path_factory.mktemp("moto") / "requests.log"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _AWS_ENV.items():
            mp.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(key, raising=False)
        # Never pick up a developer's real AWS config, nor route loopback through a proxy.
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent/lightning_async_ckpt-tests/config")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/lightning_async_ckpt-tests/credentials")
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        mp.setenv(LOG_ENV, str(log))
        try:
            with moto_server(log) as url:
                yield url
        except MotoUnavailable as exc:  # raised only while starting: moto[server] is not installed
            pytest.skip(str(exc))


def _clear_s3fs_instances() -> None:
    import s3fs

    # fsspec caches one filesystem instance per storage_options; a cached instance keeps listing caches
    # across tests. Each test starts from a new instance.
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_uri(s3_endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket on the moto server: ``(uri, storage_options)`` for ``CheckpointStore``."""
    import s3fs

    options: dict[str, Any] = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    bucket = f"lac-test-{uuid.uuid4().hex[:16]}"
    _clear_s3fs_instances()
    admin = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    admin.mkdir(bucket)
    try:
        yield f"s3://{bucket}/ckpt", options
    finally:
        try:
            admin.rm(bucket, recursive=True)
        except FileNotFoundError:
            pass
        _clear_s3fs_instances()


@pytest.fixture
def memory_uri() -> Iterator[str]:
    """A unique ``memory://`` root (fsspec's memory filesystem is process-global), removed afterwards."""
    from fsspec.implementations.memory import MemoryFileSystem

    root = f"/lac-test-{uuid.uuid4().hex[:16]}"
    yield f"memory://{root}"
    fs = MemoryFileSystem()
    if fs.exists(root):
        fs.rm(root, recursive=True)
