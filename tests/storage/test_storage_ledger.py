"""Retention from the store's ledger (issue 27 item 2): reads per pass, and what other writers did since."""

from __future__ import annotations

from pathlib import Path

from lightning_async_ckpt.storage.store import CheckpointStore


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", bytes([step % 256]) * 8)
    writer.commit()


def test_a_pass_after_a_commit_reads_only_this_runs_manifests(tmp_path: Path) -> None:
    other = CheckpointStore(str(tmp_path), run_id="other")
    for step in range(50):
        _commit(other, step)
    store = CheckpointStore(str(tmp_path), run_id="mine")
    _commit(store, 50)
    assert store.gc(2) == []
    first = store.ledger.reads
    # The first pass reads its own new generation and the newest of the other run (the end of this run's lineage).
    assert first == 2
    _commit(store, 51)
    _commit(store, 52)
    assert store.gc(2) == [50]
    # The two kept and the one removed, read as they are now; none of the other run's 50.
    assert store.ledger.reads - first == 3


def test_a_pass_sees_what_other_writers_did_since_the_last_one(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), run_id="mine")
    for step in range(3):
        _commit(store, step)
    assert store.gc(2) == [0]
    # Another process of the same run commits two newer generations; an operator removes step 1 meanwhile.
    twin = CheckpointStore(str(tmp_path), run_id="mine")
    _commit(twin, 3)
    _commit(twin, 4)
    assert twin.gc(10) == []
    other = CheckpointStore(str(tmp_path), run_id="mine")
    other.fs.rm(other.generation_path(1), recursive=True)
    # Step 2 is older than the two newest (3, 4) this pass had never seen: removed; step 1's absence is no error.
    assert store.gc(2) == [2]
    assert [g.step for g in CheckpointStore(str(tmp_path)).generations()] == [3, 4]


def test_a_manifest_damaged_since_the_last_pass_is_not_counted(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), run_id="mine")
    for step in range(3):
        _commit(store, step)
    assert store.gc(2) == [0]
    _commit(store, 3)
    # Step 3's manifest is torn after the commit the ledger remembers. Counted from memory it would be kept and step
    # 1 removed, leaving one recoverable generation; read as it is now, steps 1 and 2 are the two kept, and the
    # torn one (newer than the newest complete) may be a save in progress: left alone.
    Path(store.generation_path(3), "manifest.json").write_bytes(b"{torn")
    assert store.gc(2) == []
    assert [g.step for g in CheckpointStore(str(tmp_path)).generations()] == [1, 2]


def test_the_ledger_keeps_no_object_lists(tmp_path: Path) -> None:
    """A manifest of a many-rank save lists every rank's objects; the ledger keeps step, run id and time only."""
    other = CheckpointStore(str(tmp_path), run_id="other")
    writer = other.begin(0)
    for rank in range(64):
        writer.write_bytes(f"rank-{rank}.distcp", b"r")
    writer.commit()
    store = CheckpointStore(str(tmp_path), run_id="mine")
    _commit(store, 1)
    _commit(store, 2)
    assert store.gc(1) == [1]
    known = store.ledger._known
    assert sorted(known) == [0, 2]
    assert known[0].run_id == "other" and known[0].committed and known[0].manifest.objects == ()
    assert CheckpointStore(str(tmp_path)).manifest(0).objects[63].name == "rank-63.distcp"
