"""A generation restored from a peer for a restart (``restore_from_peers(..., background=True)``, what
``ckpt_path="last"`` with ``replicas`` and ``TieredCheckpointer.restore()`` use) is readable at once and listed only
once it is durable: while its objects' ``fsync`` and manifest are held back (gated on an event in the worker), a fresh
listing of the receiving folder shows nothing committed, ``manifest_of`` answers the manifest being committed, and
the bytes read are the source's; once released, the generation is committed with the same objects and verifies.
A process that dies before that leaves nothing listed, and the next restart receives the generation again. Worker:
tests/helpers/restored_commit_worker.py (two gloo ranks)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from tests.helpers.dist import launch_ranks, run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "restored_commit_worker.py"


@pytest.mark.slow
def test_a_restored_generation_is_read_before_it_is_durable_and_listed_only_after(tmp_path) -> None:
    receiver, holder = run_ranks(WORKER, tmp_path, "gated", timeout=180)  # rank 0 lost its folder; rank 1 holds step 3
    assert holder["agreed"] == receiver["agreed"] == [0, 3]
    # Held back: nothing listed, the bytes already readable and the source's.
    assert receiver["held"] is True
    assert receiver["listed_before"] == [] and receiver["newest_before"] is None
    assert receiver["digest_before"] == holder["digest_source"]
    assert receiver["loaded_before"] is True
    # Released: committed with the objects it was read through, verified, recorded as a replica of rank 1's.
    assert receiver["joined"] is True
    assert receiver["listed_after"] == [3] and receiver["verified_after"] is True
    assert receiver["same_objects"] is True
    assert receiver["digest_after"] == holder["digest_source"]
    assert receiver["replica_of"] == {"rank": 1, "step": 3}

    # A restart that dies before the copy is durable leaves nothing listed; the next one receives it again.
    shutil.rmtree(tmp_path / "local-0")
    crashed = launch_ranks([sys.executable, str(WORKER), str(tmp_path), "crash"], timeout=180)
    assert [p.returncode for p in crashed] == [0, 0], crashed[0].stderr[-3000:]
    assert CheckpointStore(str(tmp_path / "local-0"), check_writable=False).generations() == []
    receiver, holder = run_ranks(WORKER, tmp_path, "again", timeout=180)
    assert receiver["agreed"] == [0, 3]
    assert receiver["joined"] is True and receiver["listed_after"] == [3] and receiver["verified_after"] is True
    assert receiver["digest_after"] == holder["digest_source"]
