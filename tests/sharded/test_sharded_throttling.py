"""Object-store write discipline of sharded saves: a throttled write (503 SlowDown, 429, a reset connection) is
retried with jittered backoff, boundedly, and the retries are counted in the manifest; other errors fail at once.

Faults come from the ``faulty://`` filesystem over a local folder (:mod:`lightning_async_ckpt.testing`): the first
writes of a rank's data file raise what s3fs raises for a throttled request.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.sharded import ShardedCheckpointer, ShardedSaveError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.testing import Fault
from tests.helpers.dist import launch_ranks
from tests.helpers.sharded_worker import make_model

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "throttled_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
NO_WAIT = RetryPolicy(retries=3, backoff_s=0.0)  # the backoff's length is not what these tests check


def _state() -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _checkpointer(tmp_path: Path, faults: list[Fault], **kwargs: Any) -> ShardedCheckpointer:
    options = {"target_protocol": "file", "faults": faults}
    return ShardedCheckpointer(f"faulty://{tmp_path}", storage_options=options, **kwargs)


@pytest.mark.parametrize(
    "error",
    [
        "connection",
        OSError(errno.EBUSY, "An error occurred (SlowDown) when calling the PutObject operation: reduce your rate"),
        OSError(errno.EIO, "An error occurred (429) when calling the UploadPart operation: Too Many Requests"),
    ],
    ids=["reset", "slowdown", "429"],
)
def test_a_throttled_write_is_retried_and_the_save_commits(tmp_path: Path, error: Any) -> None:
    faults = [Fault(op="write", path="__0_0.distcp", times=2, error=error)]
    with _checkpointer(tmp_path, faults, write_retry=NO_WAIT) as ckpt:
        manifest = ckpt.save(1, _state()).result(timeout=60)
    assert manifest.extra["write_retries"] == {"0": 2}
    store = CheckpointStore(str(tmp_path))
    assert store.latest().step == 1 and store.verify(1).ok
    # Only the successful attempt's data file is left: the failed attempts' partial objects were removed.
    data = sorted(p.name for p in (tmp_path / "step-00000001").iterdir() if p.name.startswith("__0_0.distcp"))
    assert len(data) == 1, data


def test_throttling_that_persists_fails_the_save_after_the_bounded_retries(tmp_path: Path) -> None:
    faults = [Fault(op="write", path="__0_0.distcp", times=None, error="connection")]
    with _checkpointer(tmp_path, faults, write_retry=NO_WAIT) as ckpt:
        ckpt.save(1, _state())
        with pytest.raises(ShardedSaveError, match=r"step 1 failed, not committed.*after 3 retries"):
            ckpt.drain(timeout=60)
    assert not (tmp_path / "step-00000001" / MANIFEST_NAME).exists()


def test_an_io_error_that_is_no_throttling_is_not_retried(tmp_path: Path) -> None:
    faults = [Fault(op="write", path="__0_0.distcp", times=1, error="oserror")]
    with _checkpointer(tmp_path, faults, write_retry=NO_WAIT) as ckpt:
        ckpt.save(1, _state())
        with pytest.raises(ShardedSaveError, match="step 1 failed, not committed"):
            ckpt.drain(timeout=60)
    assert not (tmp_path / "step-00000001" / MANIFEST_NAME).exists()


@pytest.mark.slow
def test_one_throttled_rank_of_two_retries_and_the_save_commits(tmp_path: Path) -> None:
    procs = launch_ranks([sys.executable, str(WORKER), str(tmp_path)], timeout=120)
    results = []
    for proc in procs:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    assert [r["committed"] for r in results] == [1, 1]
    assert results[0]["write_retries"] == {"0": 0, "1": 2}
    assert results[0]["verified"]
