"""Issue 39, point 7: the local tier's retention runs one pass at a time (after a local commit on the upload
thread, after a promotion on the promotion thread), so a healthy run never logs a failed removal.

A real local folder behind the fault-injecting ``faulty://`` wrapper, which only pauses at the first removal.
"""

from __future__ import annotations

import logging
import threading

from lightning_async_ckpt import CheckpointStore
from lightning_async_ckpt.storage.promote import Promoter
from lightning_async_ckpt.testing import Fault, register_faulty


def _commit(store: CheckpointStore, step: int) -> None:
    writer = store.begin(step)
    writer.write_bytes("checkpoint.ckpt", b"step %d" % step)
    writer.commit(cut={"step": step})


def test_a_retention_pass_asked_for_during_another_one_waits_for_it(tmp_path, caplog):
    register_faulty()
    second_pass: list[threading.Thread] = []

    def during_the_first_removal(_call):
        # Another thread commits (and asks for the local tier's retention) while the first pass is removing.
        _commit(source, 3)
        thread = threading.Thread(target=promoter.committed, args=(3,), kwargs={"promote": False})
        second_pass.append(thread)
        thread.start()
        thread.join()

    fault = Fault(op="rm_file", path="manifest", callback=during_the_first_removal)
    source = CheckpointStore(f"faulty://{tmp_path / 'local'}", {"target_protocol": "file", "faults": [fault]})
    promoter = Promoter(source, CheckpointStore(str(tmp_path / "durable")), source_keep_last=1)
    _commit(source, 1)
    _commit(source, 2)
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"):
        promoter.committed(2, promote=False)
    promoter.close()

    assert second_pass and not second_pass[0].is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert [g.step for g in CheckpointStore(str(tmp_path / "local")).generations()] == [3]
