"""``accelerate/_mirrors.py``: the main process's outcomes reach the other processes' handles, and none is lost."""

from __future__ import annotations

from lightning_async_ckpt.accelerate._mirrors import MirrorBook
from lightning_async_ckpt.core.engine import SaveHandle
from lightning_async_ckpt.core.telemetry import SaveRecord
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry


def _handle(step: int) -> SaveHandle:
    return SaveHandle(step=step, record=SaveRecord(requested_step=step), decision=None)  # type: ignore[arg-type]


def _manifest(step: int) -> Manifest:
    return Manifest(step=step, run_id="r", objects=(ObjectEntry(name="a", size=3, checksum="crc32:00000000"),))


def test_a_report_stays_queued_until_a_collective_delivered_it() -> None:
    main, other = MirrorBook(main=True), MirrorBook(main=False)
    saved, failed, pending = _handle(1), _handle(2), _handle(3)
    mirrors = {h.step: _handle(h.step) for h in (saved, failed, pending)}
    for h in (saved, failed, pending):
        main.track(h)
        other.mirror(mirrors[h.step])
    saved.committed.set_result(_manifest(1))
    failed.committed.set_exception(CheckpointError("disk full"))

    report = main.report()
    assert [(step, outcome) for step, outcome, _ in report] == [(1, "committed"), (2, "failed")]
    assert main.report() == report  # that collective failed: nothing was dropped, the next one resends it
    other.absorb(report)
    main.delivered(len(report))
    assert main.report() == []  # step 3 has not ended: it stays queued, in order

    assert mirrors[1].committed.result().step == 1 and mirrors[1].uploaded.result() == 3
    assert "failed on the main process: disk full" in str(mirrors[2].committed.exception())
    assert not mirrors[3].committed.done()
    other.cancel_all()
    assert mirrors[3].committed.cancelled()
    other.absorb(report)  # a resent report for handles already resolved is harmless
