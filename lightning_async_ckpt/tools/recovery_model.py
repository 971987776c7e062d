"""Recovery time, lost work and goodput under preemptions, predicted for one tier, two tiers and a blocking save.

A first-order model (Young/Daly style), written out in ``docs/backlog-model.md``. It ignores queueing, the bandwidth
a promotion takes from the local tier, and failures during a restore.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_async_ckpt.errors import ConfigError

__all__ = ["RecoveryInputs", "RecoveryPlan", "plan_recovery"]


@dataclass(frozen=True, kw_only=True)
class RecoveryInputs:
    """What the recovery model needs (seconds, bytes, bytes per second).

    Attributes:
        state_bytes: Bytes of one checkpoint.
        local_bandwidth: Read and write bytes per second of the local tier.
        durable_bandwidth: Read and write bytes per second of the durable tier.
        local_every_s: Seconds of training between cuts to the local tier.
        durable_every_s: Seconds of training between durable checkpoints (promotions with two tiers).
        preempt_every_s: Mean seconds between preemptions.
        startup_s: Seconds a restarted process needs before it reads the checkpoint.
        node_loss: Fraction of preemptions (0-1) that also lose the local tier.
        blocking_s: Training-thread seconds per asynchronous checkpoint.
    """

    state_bytes: float
    local_bandwidth: float
    durable_bandwidth: float
    local_every_s: float
    durable_every_s: float
    preempt_every_s: float
    startup_s: float = 0.0
    node_loss: float = 0.0
    blocking_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("state_bytes", "startup_s", "blocking_s"):
            _number(name, getattr(self, name), minimum=0.0, strict=False)
        for name in ("local_bandwidth", "durable_bandwidth", "local_every_s", "durable_every_s", "preempt_every_s"):
            _number(name, getattr(self, name), minimum=0.0, strict=True)
        _number("node_loss", self.node_loss, minimum=0.0, strict=False)
        if self.node_loss > 1:
            raise ConfigError(f"node_loss is a fraction of preemptions, 0 to 1; got {self.node_loss!r}")


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """The model's prediction for one way of checkpointing.

    Attributes:
        name: ``"blocking save (ModelCheckpoint)"``, ``"one tier (durable, async)"`` or ``"two tiers"``.
        commit_latency_s: Cut to recoverable, of the checkpoint a restart usually resumes from.
        restore_s: Expected process start to first step after a preemption.
        lost_work_s: Expected training lost per preemption.
        overhead: Fraction of training time spent blocked by checkpoints.
        goodput: Training time over wall time.
    """

    name: str
    commit_latency_s: float
    restore_s: float
    lost_work_s: float
    overhead: float
    goodput: float

    def to_dict(self) -> dict[str, object]:
        """JSON-ready values."""
        return asdict(self)


def plan_recovery(inputs: RecoveryInputs) -> list[RecoveryPlan]:
    """The three ways of checkpointing under the same preemptions: blocking, one tier, two tiers (that order)."""
    x = inputs
    c_l = x.state_bytes / x.local_bandwidth
    c_d = x.state_bytes / x.durable_bandwidth
    restore_l, restore_d = x.startup_s + c_l, x.startup_s + c_d

    def plan(name: str, latency: float, restore: float, lost: float, interval: float, blocked: float) -> RecoveryPlan:
        overhead = blocked / (interval + blocked)
        goodput = max(0.0, 1.0 - (restore + lost) / x.preempt_every_s) * (1.0 - overhead)
        return RecoveryPlan(
            name=name,
            commit_latency_s=latency,
            restore_s=restore,
            lost_work_s=lost,
            overhead=overhead,
            goodput=goodput,
        )

    f = x.node_loss
    return [
        plan("blocking save (ModelCheckpoint)", c_d, restore_d, x.durable_every_s / 2, x.durable_every_s, c_d),
        plan(
            "one tier (durable, async)",
            c_d,
            restore_d,
            x.durable_every_s / 2 + c_d,
            x.durable_every_s,
            x.blocking_s,
        ),
        plan(
            "two tiers",
            c_l,
            (1 - f) * restore_l + f * restore_d,
            (1 - f) * (x.local_every_s / 2 + c_l) + f * (x.durable_every_s / 2 + c_l + c_d),
            x.local_every_s,
            x.blocking_s,
        ),
    ]


def _number(name: str, value: object, *, minimum: float, strict: bool) -> None:
    bad = isinstance(value, bool) or not isinstance(value, int | float) or value != value  # NaN
    if bad or (value <= minimum if strict else value < minimum):
        raise ConfigError(f"{name} must be a number {'>' if strict else '>='} {minimum:g}, got {value!r}")
