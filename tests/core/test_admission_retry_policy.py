"""The admission object and the retry policy, as pure units (no threads, no storage)."""

from __future__ import annotations

import errno

import pytest

from lightning_async_ckpt.core.admission import Admission, AdmissionDecision
from lightning_async_ckpt.core.persist import AbandonedError, RetryPolicy
from lightning_async_ckpt.errors import (
    AdmissionError,
    ConfigError,
    GenerationExistsError,
    StorageError,
    TornSnapshotError,
    WriterUsageError,
)


def _decide(admission: Admission, backlog: list[int], policy: str | None = None):
    waits: list[int] = []

    def wait_one() -> None:
        waits.append(backlog[0])
        backlog[0] -= 1

    result = admission.decide(7, policy=policy, backlog=lambda: backlog[0], wait_one=wait_one, committed_step=lambda: 3)
    return result, waits


def test_under_the_limit_every_policy_admits() -> None:
    for policy in ("wait", "skip", "coalesce", "abort"):
        result, waits = _decide(Admission(max_outstanding=2, policy=policy), [1])
        assert result.decision is AdmissionDecision.ADMIT and result.admitted and waits == []
        assert (result.requested_step, result.backlog, result.committed_step) == (7, 1, 3)


@pytest.mark.parametrize(
    ("policy", "decision", "admitted"),
    [("skip", AdmissionDecision.SKIP, False), ("coalesce", AdmissionDecision.COALESCE, False)],
)
def test_at_the_limit_skip_and_coalesce_drop_the_request(policy, decision, admitted) -> None:
    admission = Admission(max_outstanding=1, policy=policy)
    result, waits = _decide(admission, [1])
    assert result.decision is decision and result.admitted is admitted and waits == []
    assert admission.skipped == 1
    assert admission.pending_coalesce == (7 if policy == "coalesce" else None)
    assert admission.coalesce_due(backlog=0) is (policy == "coalesce")
    assert not admission.coalesce_due(backlog=1)


def test_at_the_limit_wait_blocks_until_a_slot_frees_and_abort_is_a_refusal() -> None:
    admission = Admission(max_outstanding=1, policy="wait")
    result, waits = _decide(admission, [2])
    assert result.decision is AdmissionDecision.WAIT and result.admitted and waits == [2, 1]
    assert result.backlog == 2
    refused, _ = _decide(admission, [1], policy="abort")  # a per-request policy overrides the default
    assert refused.decision is AdmissionDecision.ABORT and not refused.admitted
    error = admission.refusal(refused)
    assert isinstance(error, AdmissionError) and "step 7" in str(error) and "admission='abort'" in str(error)


def test_decisions_are_strings_for_logs_and_events() -> None:
    assert AdmissionDecision.WAIT == "wait" and f"{AdmissionDecision.COALESCE}" == "coalesce"
    with pytest.raises(ConfigError, match="admission"):
        _decide(Admission(max_outstanding=1, policy="wait"), [0], policy="later")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (OSError(errno.EIO, "io"), True),
        (TimeoutError("slow"), True),
        (ConnectionResetError("reset"), True),
        (StorageError("could not write"), True),
        (OSError(errno.ENOSPC, "full"), False),
        (WriterUsageError("object opened twice"), False),
        (ValueError("bad value"), False),
        (GenerationExistsError("exists"), False),
        (TornSnapshotError("torn"), False),
        (AbandonedError("abandoned"), False),
        (RuntimeError("bug"), False),
    ],
)
def test_retry_policy_retries_storage_faults_only(error: BaseException, transient: bool) -> None:
    policy = RetryPolicy(retries=2, backoff_s=0.5)
    assert policy.is_transient(error) is transient
    assert policy.should_retry(error, 0) is transient
    assert not policy.should_retry(error, 2)


def test_retry_policy_backoff_doubles_and_enospc_in_the_cause_chain_is_final() -> None:
    policy = RetryPolicy(retries=3, backoff_s=0.25)
    for attempt, base in ((1, 0.25), (2, 0.5), (3, 1.0)):
        delays = {policy.delay(attempt) for _ in range(200)}
        assert all(base <= d < 1.5 * base for d in delays)  # doubling, plus up to half again
        assert len(delays) > 1  # jittered: writers throttled together do not retry in lockstep
    wrapped = StorageError("could not finish object")
    wrapped.__cause__ = OSError(errno.ENOSPC, "full")
    assert not policy.is_transient(wrapped)
    with pytest.raises(ConfigError, match="retries"):
        RetryPolicy(retries=-1)
