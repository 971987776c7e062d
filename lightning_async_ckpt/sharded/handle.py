"""The handle of one sharded save and the error every rank raises when a sharded save failed."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.errors import CheckpointError
from lightning_async_ckpt.storage.manifest import Manifest

__all__ = ["ShardedSaveError", "ShardedSaveHandle", "describe_failure", "is_torn"]


class ShardedSaveError(CheckpointError):
    """A sharded save failed on some rank; raised on every rank, with the failing ranks named.

    Attributes:
        torn: The runtime guard refused the save on some rank (a deferred shard changed before it was staged):
            nothing is broken, the checkpoint is retaken (the torn categories are copied at the cut from then on).
    """

    torn: bool = False


@dataclass(eq=False)
class ShardedSaveHandle:
    """One sharded save, with three real futures.

    Attributes:
        step: The generation's step.
        staged: Resolves when every local shard was copied to host buffers (the training may mutate them); at
            once when nothing was deferred, else on the background thread.
        uploaded: Resolves to this rank's :class:`RankObjects` once its objects are durable.
        committed: Resolves to the committed :class:`Manifest` (on every rank) once the coordinator wrote it
            (``None`` on a non-coordinator rank that could not read it back; the step is committed all the same).
        blocked_s: Seconds the training thread spent in ``save`` (waiting for the previous save, and copying).
        sync_bytes: Bytes copied at the cut (on the training thread).
        deferred_bytes: Bytes staged in the background, behind the fences.
    """

    step: int
    staged: Future = field(default_factory=Future)
    uploaded: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    blocked_s: float = 0.0
    sync_bytes: int = 0
    deferred_bytes: int = 0
    _job: StagingJob | None = field(default=None, repr=False)

    @property
    def fence_wait_s(self) -> float:
        """Seconds the training thread waited at this save's fences so far."""
        return 0.0 if self._job is None else sum(state.waited_s for state in self._job.fences.values())

    def result(self, timeout: float | None = None) -> Manifest | None:
        """The committed manifest (raises the save's error)."""
        return self.committed.result(timeout)


def is_torn(exc: BaseException) -> bool:
    """Whether ``exc`` (or, for DCP's ``CheckpointException``, any rank's failure) is a guard refusal."""
    from lightning_async_ckpt.errors import TornSnapshotError

    failures = getattr(exc, "failures", None)
    errors = [exc] if not isinstance(failures, dict) else list(failures.values())
    errors = [e[0] if isinstance(e, tuple) else e for e in errors]
    return any(isinstance(e, TornSnapshotError) or "TornSnapshotError" in repr(e) for e in errors)


def describe_failure(exc: BaseException) -> str:
    """One line naming every failing rank and its error (DCP's ``CheckpointException`` lists them)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank in sorted(failures):
            err = failures[rank]
            err = err[0] if isinstance(err, tuple) else err
            parts.append(f"rank {rank}: {type(err).__name__}: {err}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"
