"""The handle of one sharded save and the error every rank raises when a sharded save failed."""

from __future__ import annotations

from lightning_async_ckpt.core.handle import SaveHandle
from lightning_async_ckpt.errors import CheckpointError

__all__ = ["ShardedSaveError", "ShardedSaveHandle", "describe_failure", "is_torn"]


class ShardedSaveError(CheckpointError):
    """A sharded save failed on some rank; raised on every rank, with the failing ranks named.

    Attributes:
        torn: The runtime guard refused the save on some rank (a deferred shard changed before it was staged):
            nothing is broken, the checkpoint is retaken (the torn categories are copied at the cut from then on).
    """

    torn: bool = False


#: A sharded save's handle is the engine's: one handle type for every save (three real futures; ``uploaded``
#: resolves to this rank's :class:`~lightning_async_ckpt.sharded.dcp_writer.RankObjects`, ``committed`` to the
#: manifest, or ``None`` on a rank that could not read it back although the step is committed).
ShardedSaveHandle = SaveHandle


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
