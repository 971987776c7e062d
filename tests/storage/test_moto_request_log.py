"""The request log of the session's moto server (its own process): exact, and written before each answer.

The request-count tests (``test_commit_requests.py``, ``test_storage_requests.py``, ``test_part_size.py``,
``tests/tools/test_cli.py``) rely on ``tests/helpers/s3_requests.py`` seeing every request the server answered
while the block ran, and nothing else.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers.s3_requests import s3_requests


def _fs(s3_uri: tuple[str, dict[str, Any]]) -> tuple[Any, str]:
    import s3fs

    uri, options = s3_uri
    return s3fs.S3FileSystem(skip_instance_cache=True, **options), uri.removeprefix("s3://")


def test_the_server_is_a_process_of_its_own(s3_endpoint: str) -> None:
    import psutil

    port = int(s3_endpoint.rsplit(":", 1)[1])
    listeners = [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"]
    assert listeners, f"nothing listens on {s3_endpoint}"
    assert all(c.pid != os.getpid() for c in listeners)


def test_each_request_is_logged_before_its_answer_and_only_inside_the_block(s3_uri: tuple[str, dict[str, Any]]) -> None:
    fs, root = _fs(s3_uri)
    fs.pipe(f"{root}/before", b"x")  # answered before the block: not counted
    with s3_requests() as log:
        for i in range(20):
            fs.pipe(f"{root}/k{i}", b"x")
            # The call has returned, so the server answered: its line must already be in the log.
            assert log.requests[-1] == ("PUT", f"/{root}/k{i}", 200)
            assert log.total == i + 1
        with pytest.raises(FileNotFoundError):
            fs.info(f"{root}/missing")
        fs.ls(root)
    fs.pipe(f"{root}/after", b"x")  # answered after the block: not counted

    assert ("HEAD", f"/{root}/missing", 404) in log.requests  # werkzeug colours non-200 lines; they still parse
    assert not any(t.endswith(("/before", "/after")) for _, t, _ in log.requests), log.requests
    counts = log.counts()
    assert counts["PUT"] == 20 and counts["HEAD"] == 1 and counts["LIST"] >= 2, log.requests
