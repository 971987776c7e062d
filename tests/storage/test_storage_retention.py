"""Retention as a pure plan: ``plan_retention`` decides from what the store found, with no I/O."""

from __future__ import annotations

from lightning_async_ckpt.storage.generation import GenerationInfo
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.retention import FOREIGN, Candidate, plan_retention


def _committed(step: int, run: str = "me", problems: tuple[str, ...] | None = ()) -> Candidate:
    manifest = Manifest(step=step, run_id=run, objects=())
    return Candidate(GenerationInfo(step=step, path=f"s/{step}", committed=True, manifest=manifest), problems)


def _leftover(step: int, writers: tuple[str, ...] = (), age_s: float | None = None, **kw) -> Candidate:
    return Candidate(GenerationInfo(step=step, path=f"s/{step}", committed=False, **kw), None, writers, age_s)


def _plan(cands, keep_last=1, **kw):
    return plan_retention(cands, keep_last=keep_last, run_id="me", all_runs=kw.pop("all_runs", False), **kw)


def test_keeps_the_newest_complete_and_removes_older_ones():
    plan = _plan([_committed(1), _committed(2), _committed(3)], keep_last=2)
    assert plan.keep == (2, 3) and [r.step for r in plan.remove] == [1] and plan.refused == ()


def test_a_damaged_generation_is_never_counted_and_is_reported():
    plan = _plan([_committed(1), _committed(2), _committed(3, problems=("checkpoint.ckpt: missing",))])
    assert plan.keep == (2,) and [r.step for r in plan.remove] == [1]
    assert [(r.step, "checkpoint.ckpt: missing" in r.reason) for r in plan.refused] == [(3, True)]


def test_nothing_is_removed_without_a_complete_generation():
    plan = _plan([_committed(1, problems=("x: missing",)), _committed(2, problems=("y: missing",)), _leftover(0)])
    assert plan.keep == () and plan.remove == ()
    assert any("no verified complete generation" in r.reason for r in plan.refused)


def test_other_runs_generations_and_leftovers_are_left_to_them():
    cands = [_committed(1, "other"), _leftover(2, ("other",)), _committed(3), _committed(4)]
    plan = _plan(cands)
    assert plan.keep == (4,) and [r.step for r in plan.remove] == [3]
    assert [(r.step, "written by other" in r.reason) for r in plan.refused] == [(2, True)]
    everyone = _plan(cands, all_runs=True)
    assert [r.step for r in everyone.remove] == [1, 2, 3]


def test_leftover_rules():
    cands = [
        _leftover(1, ("me",)),  # this run's crashed attempt
        _leftover(2, ()),  # no claim and no manifest: files the library never wrote (issue 39)
        _leftover(3, ("other",), age_s=10.0),
        _leftover(4, ("?",)),  # a torn claim: unknown writer
        _leftover(5, newer_format=True, error="newer"),
        _leftover(6, unreadable=True, error="timeout"),
        _leftover(7, error="corrupt json"),  # a rejected manifest: never recoverable
        _committed(8),
        _leftover(9, ("me",)),  # newer than the newest commit: may be in progress
    ]
    plan = _plan(cands, writing=frozenset({1}))
    assert [r.step for r in plan.remove] == [7]  # 1 is being written by this store
    assert sorted(r.step for r in plan.refused) == [2, 3, 4, 5, 6, 9]
    assert [r.reason for r in plan.refused if r.step == 2] == [FOREIGN]
    # What this store's own failed attempt or removal left (no claim either) is collected.
    assert [r.step for r in _plan(cands, writing=frozenset({1}), ours=frozenset({2})).remove] == [2, 7]
    operator = _plan(cands, all_runs=True, min_leftover_age_s=60.0, writing=frozenset({1}))
    assert [r.step for r in operator.remove] == [2, 4, 7]  # 3 is younger than a minute; 4's age is unknown
