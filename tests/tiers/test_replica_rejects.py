"""A replica message the receiver cannot accept (tiers/replicas.py, tiers/replica_wire.py) over real gloo processes:
its target folder is checked against the receiver's own tier, a rejected message is answered with a failure the
sender raises, the receiving thread lives on, and ``replicate()`` after ``close()`` says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.tiers.replica_wire import Kind
from tests.helpers.dist import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "replica_rejects_worker.py"


@pytest.mark.slow
def test_rejected_replica_messages_are_answered_and_the_receiver_lives_on(tmp_path):
    sender, receiver = run_ranks(WORKER, tmp_path, timeout=180)  # every rank exited 0; its last RESULT line
    # A target folder outside the receiver's tier is refused, and the sender raises naming it.
    assert sender["dotdot"].startswith("ReplicaError") and "../escape" in sender["dotdot"]
    assert sender["absolute"].startswith("ReplicaError") and "absolute" in sender["absolute"]
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "absolute").exists()
    # A manifest the receiver rejects is answered with a failure naming the object (the sender is not left waiting).
    kind, why = sender["pwned"]
    assert kind == Kind.FAIL and "../../../pwned" in why
    assert not (tmp_path / "pwned").exists()
    # The receiving thread lived on: the next generation was committed in the receiver's own tier.
    assert sender["good"] == "copied" and receiver["received"] == [2]
    assert [g.step for g in CheckpointStore(str(tmp_path / "tier"), check_writable=False).generations()] == [2]
    # replicate() after close() replicates nothing and says so at WARNING.
    assert any(r.startswith("WARNING") and "closed" in r for r in sender["after_close"]), sender["after_close"]
