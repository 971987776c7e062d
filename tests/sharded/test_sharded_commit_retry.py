"""A sharded commit's own PUTs (DCP's ``.metadata``, ``manifest.json``) ride out throttling without overwriting.

Faults come from the ``faulty://`` filesystem over a local folder, which the store drives as an object store (the
generic backend: exclusive create by check-then-write, manifest by one ``pipe_file``). Each test failed before the
backend retried exclusive PUTs: the save was not committed.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.sharded import ShardedCheckpointer, ShardedSaveError
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.storage.throttling import PutRetry, is_throttled
from lightning_async_ckpt.testing import Fault
from tests.helpers.sharded_worker import make_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
SLOW_DOWN = OSError(errno.EBUSY, "An error occurred (SlowDown) when calling the PutObject operation: reduce your rate")
NO_WAIT = RetryPolicy(retries=3, backoff_s=0.0)  # the backoff's length is not what these tests check


def _state() -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _save(tmp_path: Path, faults: list[Fault]) -> Any:
    """Save step 1 through ``faults``; the manifest, and every call a fault fired on."""
    store = CheckpointStore(f"faulty://{tmp_path}", {"target_protocol": "file", "faults": faults})
    store.backend.put_retry = PutRetry(retries=3, backoff_s=0.0)
    with ShardedCheckpointer(store, write_retry=NO_WAIT) as ckpt:
        return ckpt.save(1, _state()).result(timeout=60), [(c.op, c.path.rsplit("/", 1)[-1]) for c in store.fs.fired]


def _committed(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    assert store.latest().step == 1 and store.verify(1).ok
    folder = tmp_path / "step-00000001"
    assert not [p.name for p in folder.iterdir() if ".tmp" in p.name or p.name.startswith(".writer")]


def test_a_throttled_manifest_put_is_retried_exclusively(tmp_path: Path) -> None:
    faults = [Fault(op="pipe_file", path=MANIFEST_NAME, times=2, error=SLOW_DOWN)]
    manifest, fired = _save(tmp_path, faults)
    assert manifest.step == 1 and fired == [("pipe_file", MANIFEST_NAME)] * 2
    _committed(tmp_path)


def test_a_manifest_put_whose_answer_was_lost_is_recognised_as_this_writer_s(tmp_path: Path) -> None:
    # The PUT lands, then the connection resets: the retry finds the name taken, by exactly its own bytes.
    faults = [Fault(op="pipe_file", path=MANIFEST_NAME, times=1, error="connection", after=True)]
    manifest, fired = _save(tmp_path, faults)
    assert fired == [("pipe_file", MANIFEST_NAME)]
    _committed(tmp_path)
    assert CheckpointStore(str(tmp_path)).manifest(1) == manifest


def test_a_throttled_metadata_write_and_publish_are_retried(tmp_path: Path) -> None:
    faults = [
        Fault(op="write", path=".metadata.tmp", times=2, error=SLOW_DOWN),  # the temporary object: written again
        Fault(op="open", path="/.metadata", at=4, times=2, error="connection"),  # its exclusive publish: retried
    ]
    _, fired = _save(tmp_path, faults)
    assert [op for op, _ in fired] == ["write", "write", "open", "open"]
    assert [name for _, name in fired][2:] == [".metadata", ".metadata"]
    _committed(tmp_path)


def test_another_writer_s_metadata_is_never_replaced_by_a_retry(tmp_path: Path) -> None:
    # A reset publish whose retry finds another attempt's .metadata: not this writer's bytes, not committed.
    (tmp_path / "step-00000001").mkdir()

    def plant(call: Any) -> None:
        (tmp_path / "step-00000001" / ".metadata").write_bytes(b"another attempt's metadata")

    faults = [
        Fault(op="open", path="/.metadata", at=2, times=1, error="connection"),  # the publish's first PUT: reset
        Fault(op="exists", path="/.metadata", at=3, times=1, callback=plant),  # another attempt publishes first
    ]
    with pytest.raises(ShardedSaveError, match="another attempt published it"):
        _save(tmp_path, faults)
    assert (tmp_path / "step-00000001" / ".metadata").read_bytes() == b"another attempt's metadata"
    assert not (tmp_path / "step-00000001" / MANIFEST_NAME).exists()


def test_throttling_words() -> None:
    assert is_throttled(SLOW_DOWN) and is_throttled(ConnectionResetError())
    assert not is_throttled(OSError(errno.ENOSPC, "SlowDown? no: the disk is full"))
    assert not is_throttled(OSError(errno.EIO, "I/O error"))
