"""Issue 39, point 7: the local tier's retention runs one pass at a time (after a local commit on the upload
thread, after a promotion on the promotion thread), so a healthy run never logs a failed removal.

A real local folder behind the fault-injecting ``faulty://`` wrapper, which only pauses at the first removal.
"""

from __future__ import annotations

import logging
import threading

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.testing import Fault, register_faulty
from lightning_async_ckpt.tiers.promote import Promoter


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", b"step %d" % step)
    writer.commit(cut={"step": step})


def test_a_retention_pass_asked_for_during_another_one_waits_for_it(tmp_path, caplog):
    register_faulty()
    second_pass: list[threading.Thread] = []
    returned_at_once: list[bool] = []  # whether the second pass returned while the first one was still removing

    def during_the_first_removal(_call):
        # Another thread commits (and asks for the local tier's retention) while the first pass is removing.
        _commit(source, 3)
        thread = threading.Thread(target=promoter.committed, args=(3,), kwargs={"promote": False})
        second_pass.append(thread)
        thread.start()
        thread.join(60)  # bounded: a second pass that blocked on the first would deadlock here, not fail below
        returned_at_once.append(not thread.is_alive())

    fault = Fault(op="rm_file", path="manifest", callback=during_the_first_removal)
    source = CheckpointStore(f"faulty://{tmp_path / 'local'}", {"target_protocol": "file", "faults": [fault]})
    promoter = Promoter(source, CheckpointStore(str(tmp_path / "durable")), source_keep_last=1)
    _commit(source, 1)
    _commit(source, 2)
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        promoter.committed(2, promote=False)
    promoter.close()

    assert second_pass and returned_at_once == [True] and not second_pass[0].is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert [g.step for g in CheckpointStore(str(tmp_path / "local")).generations()] == [3]


def test_a_durable_tier_lagging_more_than_its_bound_warns_once_and_says_by_how_much(tmp_path, caplog):
    # Issue 39, point 11: promotions slower than the cadence fall behind with no sign (a newer due generation
    # replaces a pending one); past LAG_WARN_GENERATIONS it is a WARNING, and `lag` is what metrics show.
    from lightning_async_ckpt.tiers.promote import LAG_WARN_GENERATIONS

    release = threading.Event()
    stalled = threading.Event()
    fault = Fault(op="pipe_file", path="manifest", stall=release, callback=lambda _call: stalled.set())
    target = CheckpointStore(f"faulty://{tmp_path / 'durable'}", {"target_protocol": "file", "faults": [fault]})
    source = CheckpointStore(str(tmp_path / "local"))
    events: list[tuple[str, dict]] = []
    promoter = Promoter(source, target, on_event=lambda name, **fields: events.append((name, fields)))
    _commit(source, 1)
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        promoter.committed(1, promote=True)
        assert stalled.wait(60)  # step 1's promotion is writing its manifest
        steps = range(2, LAG_WARN_GENERATIONS + 4)
        for step in steps:
            _commit(source, step)
            promoter.committed(step, promote=True)
        assert promoter.lag == len(steps) + 1  # every due generation newer than the newest promoted one
        release.set()
        assert promoter.drain(60)
    promoter.close()
    lagging = [r.getMessage() for r in caplog.records if "behind" in r.getMessage()]
    assert len(lagging) == 1, lagging
    assert [name for name, _ in events].count("promotion_lagging") == 1
    assert promoter.lag == 0 and promoter.promoted_step == steps[-1]
