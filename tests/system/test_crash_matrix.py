"""Crash matrix: a real Lightning run SIGKILLed at 30+ points; nothing committed is ever lost.

Each point is one child process forked from a pre-imported zygote (``tests/helpers/crash_worker.py serve``, itself
forked from the session's zygote, ``tests/helpers/forked.py``): it trains a small model for 8 steps with a cut every
2 steps and ``keep_last=2``, into ``faulty://<dir>`` (the object-store commit path over a local folder), and is
killed with SIGKILL at its point: inside the capture (the module's ``on_save_checkpoint``, called while the
checkpoint is dumped at the cut), during staging (the next step's forward and its optimizer fence), during the
upload (the k-th open/write/close of the data object), around the manifest PUT (and halfway through it: a torn
manifest), and around retention's deletes. Then, in this process:

* the newest generation is committed and every committed generation verifies (sizes and checksums);
* its step is at most the last step the run requested, and at least the newest step it reported committed;
* no reported commit was lost, except those retention legitimately removed (at least ``keep_last`` newer
  committed generations exist);
* ``latest_checkpoint`` names it and a new run resumes from it in the same dirpath, commits its next cut, and
  retention then keeps exactly the newest ``keep_last`` generations (the resumed run continues the run id).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore, latest_checkpoint
from lightning_async_ckpt.lightning import CHECKPOINT_NAME
from lightning_async_ckpt.testing import FaultyFileSystem
from tests.helpers.dist import ZYGOTE_START_TIMEOUT_S
from tests.helpers.forked import Worker, start_script
from tests.helpers.models import BNDropoutModel, make_loader, trainer_kwargs

pytestmark = pytest.mark.slow
DATA = ".ckpt"  # the checkpoint file, named by the filename template (epoch=E-step=S.ckpt)

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "crash_worker.py"
MAX_STEPS, EVERY, KEEP_LAST = 8, 2, 2
CUTS = list(range(EVERY, MAX_STEPS + 1, EVERY))
SCENARIO_TIMEOUT_S = 300  # a scenario's child is killed by its own alarm after crash_worker.CHILD_ALARM_S (60 s)


class _Zygote:
    """The worker process that forks one child per scenario (itself forked from the session's rank zygote)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        ready = worker.readline(timeout=ZYGOTE_START_TIMEOUT_S).strip()
        assert ready == "READY", f"crash worker did not start: {ready!r}\n{worker.stderr[-4000:]}"

    def run(self, scenario: dict) -> int:
        self.worker.write(json.dumps(scenario) + "\n")
        line = self.worker.readline(timeout=SCENARIO_TIMEOUT_S)  # a child outliving CHILD_ALARM_S is killed
        assert line, f"crash worker exited\n{self.worker.stderr[-4000:]}"
        return json.loads(line)["rc"]


@pytest.fixture(scope="module")
def zygote() -> Iterator[_Zygote]:
    # Lightning is already imported in the session's zygote; leaving the block kills the worker (it holds no state).
    with start_script([sys.executable, str(WORKER), "serve"], cwd=WORKER.parent.parent, stdin=True) as worker:
        yield _Zygote(worker)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("crash")


def _scenario(base: Path, name: str, kill: dict | None, counts: bool = False) -> dict:
    return {
        "dir": str(base / name),
        "events": str(base / f"{name}.events.jsonl"),
        "max_steps": MAX_STEPS,
        "every": EVERY,
        "keep_last": KEEP_LAST,
        "kill": kill,
        "counts": str(base / f"{name}.counts.json") if counts else None,
    }


@pytest.fixture(scope="module")
def calls(zygote: _Zygote, base: Path) -> dict[str, int]:
    """Filesystem calls of one uninterrupted run, to place kill points at exact calls."""
    sc = _scenario(base, "calibration", None, counts=True)
    rc = zygote.run(sc)
    assert rc == 0, Path(sc["dir"] + ".log").read_text()[-4000:]
    counts = json.loads(Path(sc["counts"]).read_text())
    assert counts["open"] == len(CUTS) and counts["pipe_file"] == len(CUTS)
    assert counts["rm_file"] == len(CUTS) - KEEP_LAST
    store = CheckpointStore(sc["dir"], check_writable=False)
    assert [g.step for g in store.generations()] == CUTS[-KEEP_LAST:]
    return counts


def _fault(
    op: str, at: int | Callable[[int], int], *, path: str | None = None, after: bool = False, torn: bool = False
) -> dict:
    return {"fault": {"op": op, "at": at, "path": path, "after": after, "torn": torn}}


# Positions over all T data writes of the run (resolved against the calibration counts): 4 generations.
WRITE_POINTS = {
    "first": lambda t: 1,
    "gen1-middle": lambda t: t // 8,
    "gen1-last": lambda t: t // 4,
    "gen2-first": lambda t: t // 4 + 1,
    "middle": lambda t: t // 2,
    "gen4-first": lambda t: 3 * t // 4 + 1,
    "second-to-last": lambda t: t - 1,
    "last": lambda t: t,
}


POINTS: list[tuple[str, str, dict]] = []
for s in CUTS:
    POINTS.append(("capture", f"on_save_checkpoint@{s}", {"hook": "on_save_checkpoint", "step": s}))
for s in CUTS[:-1]:
    POINTS.append(("staging", f"forward-after-cut@{s}", {"hook": "training_step", "step": s}))
    POINTS.append(("staging", f"optimizer-fence-after-cut@{s}", {"hook": "on_before_optimizer_step", "step": s}))
for k in range(1, len(CUTS) + 1):
    POINTS.append(("upload", f"open#{k}", _fault("open", k, path=DATA)))
for label, at in WRITE_POINTS.items():
    POINTS.append(("upload", f"write-{label}", _fault("write", at, path=DATA)))
POINTS.append(("upload", "close#1", _fault("close", 1, path=DATA)))
POINTS.append(("upload", "close#3", _fault("close", 3, path=DATA)))
POINTS.append(("upload", "after-close#2", _fault("close", 2, path=DATA, after=True)))
for k in range(1, len(CUTS) + 1):
    POINTS.append(("manifest", f"before-put#{k}", _fault("pipe_file", k, path="manifest.json")))
    POINTS.append(("manifest", f"after-put#{k}", _fault("pipe_file", k, path="manifest.json", after=True)))
    # faulty:// puts are not atomic: a kill halfway through leaves a torn manifest (seen once in CI, by timing).
    POINTS.append(("manifest", f"torn-put#{k}", _fault("pipe_file", k, path="manifest.json", torn=True)))
for k in (1, 2):
    POINTS.append(("retention", f"before-manifest-rm#{k}", _fault("rm_file", k, path="manifest.json")))
    POINTS.append(("retention", f"after-manifest-rm#{k}", _fault("rm_file", k, path="manifest.json", after=True)))
POINTS.append(("retention", "before-data-rm#1", _fault("rm", 1)))
POINTS.append(("retention", "before-data-rm#2", _fault("rm", 2)))
POINTS.append(("retention", "after-data-rm#1", _fault("rm", 1, after=True)))


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line torn by the kill
    return out


def test_matrix_covers_every_phase():
    # Importing lightning_async_ckpt.testing registered faulty:// (the resumed runs use it, as the crashed ones did).
    import fsspec

    assert fsspec.get_filesystem_class("faulty") is FaultyFileSystem
    phases = {phase for phase, _, _ in POINTS}
    assert phases == {"capture", "staging", "upload", "manifest", "retention"}
    assert len(POINTS) >= 30


@pytest.mark.parametrize(("phase", "name", "kill"), POINTS, ids=[f"{p}-{n}" for p, n, _ in POINTS])
def test_sigkill_loses_nothing_committed(zygote, base, calls, phase, name, kill):
    if "fault" in kill and callable(kill["fault"]["at"]):
        kill = {"fault": {**kill["fault"], "at": kill["fault"]["at"](calls["write"])}}
    sc = _scenario(base, f"{phase}-{name}".replace("#", "").replace("@", "-"), kill)
    rc = zygote.run(sc)
    log = Path(sc["dir"] + ".log")
    assert rc == -9, f"the kill point was not reached (exit code {rc}):\n{log.read_text()[-4000:]}"

    events = _events(Path(sc["events"]))
    requested = [e["step"] for e in events if e["event"] == "request" and e["decision"] in ("admit", "wait")]
    reported = [e["step"] for e in events if e["event"] == "committed"]

    store = CheckpointStore(sc["dir"], check_writable=False)
    present = [g.step for g in store.generations()]
    for step in present:
        assert store.verify(step).ok, f"committed generation {step} does not verify: {store.verify(step).problems}"
    latest = store.latest(verify=True)
    if reported:
        assert latest is not None and latest.step >= max(reported), (reported, present)
    if latest is not None:
        assert requested and latest.step <= max(requested), (requested, latest.step)
        assert latest.step == max(present)
    # Nothing reported committed was lost, except what retention may remove: at least KEEP_LAST newer commits.
    for step in reported:
        if step not in present:
            assert sum(s > step for s in present) >= KEEP_LAST, (step, reported, present)
    assert len([s for s in reported if s in present]) >= min(KEEP_LAST, len(reported))

    path = latest_checkpoint(sc["dir"])
    assert path == (store.object_url(latest.step, CHECKPOINT_NAME) if latest else None)
    _resume_and_continue(sc["dir"], path, latest.step if latest else 0, present)


def _resume_and_continue(dirpath: str, ckpt_path: str | None, start: int, before: list[int]) -> None:
    """A new run resumes from the newest commit in the same dirpath, commits its next cut and retires the rest."""
    pl.seed_everything(7)
    # The same dirpath URL and storage options as the crashed run, so Lightning restores the callback's state too.
    callback = AsyncCheckpointCallback(
        dirpath=f"faulty://{dirpath}",
        storage_options={"target_protocol": "file"},
        every_n_train_steps=EVERY,
        keep_last=KEEP_LAST,
    )
    trainer = pl.Trainer(max_steps=start + EVERY, callbacks=[callback], **trainer_kwargs())
    trainer.fit(BNDropoutModel(), make_loader(), ckpt_path=ckpt_path)
    assert trainer.global_step == start + EVERY
    store = CheckpointStore(dirpath, check_writable=False)
    steps = [g.step for g in store.generations()]
    # The resumed run continues the crashed run (its run id travels in the checkpoint), so its retention keeps
    # exactly the newest KEEP_LAST generations of the two together.
    assert steps == sorted({*before, start + EVERY})[-KEEP_LAST:], (before, steps)
    assert store.verify(start + EVERY).ok
