"""``plan``'s request model (``--ranks``/``--generations``) and recovery model (``--state-bytes``): formulas and flags.

The request counts themselves are pinned to a moto server's by ``tests/storage/test_commit_requests.py`` (one
writer) and measured for 2-16 ranks by ``benchmarks/bench_scale.py``; these tests pin the formulas' arithmetic, the
time rules and the command line.
"""

from __future__ import annotations

import json

import pytest

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.tools.cli import main
from lightning_async_ckpt.tools.recovery_model import RecoveryInputs, plan_recovery
from lightning_async_ckpt.tools.request_model import (
    pages,
    predict_latest_checkpoint,
    predict_resume,
    predict_save,
    predict_sharded_save,
)


# -- request model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_save_matches_the_counts_measured_on_moto(ranks: int) -> None:
    # benchmarks/bench_scale.py --ranks 2,3 on a moto server (a later save, keep_last=2, three generations listed).
    measured = {
        2: {"LIST": 10, "GET": 8, "HEAD": 3, "PUT": 8, "POST": 1, "DELETE": 5},
        3: {"LIST": 10, "GET": 9, "HEAD": 3, "PUT": 10, "POST": 1, "DELETE": 6},
    }
    assert predict_sharded_save(ranks=ranks, generations=3, keep_last=2).requests == measured[ranks]


def test_only_the_folder_listing_grows_with_generations() -> None:
    small = predict_sharded_save(ranks=16, generations=10).requests
    large = predict_sharded_save(ranks=16, generations=10_000).requests
    assert {k: large[k] - small[k] for k in large} == {k: (9 if k == "LIST" else 0) for k in large}
    assert pages(0) == pages(1) == pages(1000) == 1 and pages(1001) == 2 and pages(10_000) == 10


def test_ranks_write_in_parallel_so_the_serial_path_is_flat_in_ranks() -> None:
    few, many = predict_sharded_save(ranks=2, generations=10), predict_sharded_save(ranks=1024, generations=10)
    assert many.total > 50 * few.total  # thousands of requests ...
    assert many.serial - few.serial < 20  # ... but the coordinator's path grows only by listing pages


def test_time_is_latency_times_serial_or_the_tightest_rate_limit() -> None:
    plan = predict_save(objects=1, generations=10, latency_s=0.01)
    assert plan.time_s == pytest.approx(plan.serial * 0.01) and plan.bound == "latency"
    big = predict_sharded_save(ranks=1024, generations=10, latency_s=0.015, put_rate=3500, get_rate=5500)
    put_class = sum(big.requests.get(k, 0) for k in ("PUT", "POST", "DELETE"))
    assert big.bound == "put_rate" and big.time_s == pytest.approx(put_class / 3500)
    resume = predict_resume(objects=1025, generations=10, latency_s=0.0, get_rate=100)
    assert resume.bound == "get_rate" and resume.time_s == pytest.approx(resume.total / 100)
    assert predict_latest_checkpoint(generations=5000).requests == {"LIST": 5, "GET": 2, "HEAD": 1}


@pytest.mark.parametrize("kwargs", [{"ranks": -1}, {"put_rate": -5}, {"latency_s": "fast"}])
def test_bad_request_model_input_names_the_argument(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        predict_sharded_save(**{"ranks": 4, "generations": 10, **kwargs})


# -- recovery model ----------------------------------------------------------------------------------------
def _inputs(**kw: float) -> RecoveryInputs:
    base = dict(
        state_bytes=10e9,
        local_bandwidth=2e9,
        durable_bandwidth=200e6,
        local_every_s=300,
        durable_every_s=1800,
        preempt_every_s=14_400,
        startup_s=60,
    )
    return RecoveryInputs(**{**base, **kw})


def test_recovery_formulas() -> None:
    blocking, one, two = plan_recovery(_inputs())
    # durable: 10 GB / 200 MB/s = 50 s; local: 5 s
    assert blocking.restore_s == one.restore_s == pytest.approx(110)
    assert two.restore_s == pytest.approx(65)
    assert blocking.lost_work_s == pytest.approx(900)  # half an interval, recoverable at once
    assert one.lost_work_s == pytest.approx(950)  # plus the commit latency
    assert two.lost_work_s == pytest.approx(155)
    assert blocking.overhead == pytest.approx(50 / 1850) and one.overhead == 0 == two.overhead
    assert one.goodput == pytest.approx(1 - (110 + 950) / 14_400)
    assert blocking.goodput == pytest.approx((1 - (110 + 900) / 14_400) * (1 - 50 / 1850))
    assert two.goodput > one.goodput and two.goodput > blocking.goodput


def test_losing_the_node_every_time_makes_two_tiers_a_slower_one_tier() -> None:
    _, one, two = plan_recovery(_inputs(node_loss=1.0))
    assert two.restore_s == one.restore_s
    assert two.lost_work_s == pytest.approx(one.lost_work_s + 5)  # the local commit before the promotion
    assert two.goodput < one.goodput


def test_goodput_never_goes_negative() -> None:
    assert all(p.goodput == 0 for p in plan_recovery(_inputs(preempt_every_s=10)))


@pytest.mark.parametrize(
    ("kw", "name"), [({"node_loss": 1.5}, "node_loss"), ({"durable_bandwidth": 0}, "durable_bandwidth")]
)
def test_bad_recovery_input_names_the_field(kw: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        _inputs(**kw)


# -- command line ------------------------------------------------------------------------------------------
def test_plan_requests_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--ranks", "16", "--generations", "1000", "--request-latency", "15ms", "--put-rate", "3500"]
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    expected = predict_sharded_save(ranks=16, generations=1001, latency_s=0.015, put_rate=3500)
    assert body["save"]["requests"] == expected.requests and body["save"]["time_s"] == pytest.approx(expected.time_s)
    assert body["resume_one_rank"]["requests"] == predict_resume(objects=17, generations=1000).requests
    assert body["resume_every_rank"]["total"] == 16 * body["resume_one_rank"]["total"]
    assert body["request_latency_s"] == pytest.approx(0.015)


def test_plan_requests_text_for_one_writer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--generations", "10"]) == 0
    out = capsys.readouterr().out
    assert "per save:" in out and "24 requests" in out and "per resume, one rank:" in out
    assert "every rank" not in out


def test_plan_recovery_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--state-bytes",
        "10GB",
        "--local-bandwidth",
        "2GB/s",
        "--durable-bandwidth",
        "200MB/s",
        "--local-every",
        "5min",
        "--durable-every",
        "30min",
        "--preempt-every",
        "4h",
        "--startup",
        "60s",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "two tiers" in out and "goodput" in out and "blocking save (ModelCheckpoint)" in out
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in body["plans"]][2] == "two tiers"
    assert body["plans"][2]["restore_s"] == pytest.approx(65)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--ranks", "4"], "missing --generations"),
        (["plan", "--generations", "10", "--bytes", "1GB"], "exactly one of"),
        (["plan", "--state-bytes", "1GB", "--local-bandwidth", "1GB/s"], "missing --durable-bandwidth"),
        (["plan", "--generations", "10", "--horizon", "5"], "backlog model"),
        (["plan", "--generations", "10", "--request-latency", "soon"], "not a duration"),
        (["plan", "--ranks", "0", "--generations", "10"], "--ranks >= 1"),
    ],
)
def test_plan_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
