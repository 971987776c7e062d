"""Work done once per job: rank 0 reads the store, every rank gets its answer (or rank 0's error).

:func:`once` runs a lookup on rank 0 only and broadcasts its result, or its exception (raised on every rank with a
note naming rank 0). :func:`job_broadcast` uses the default group when it is gloo, else one gloo group created at
the first call; Lightning code passes ``trainer.strategy.broadcast`` (:func:`lightning_broadcast`).

Thread-safety: call from the training thread, on every rank in the same order (a collective).
"""

from __future__ import annotations

import logging
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_async_ckpt.errors import StorageError

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.generation import GenerationInfo
    from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["Broadcast", "job_broadcast", "latest_once", "lightning_broadcast", "once"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

# The gloo group that carries lookups beside a non-gloo default group, one per default group (weakly held: a
# destroyed and re-created default group gets a new one). Creating it is a collective, so it is created once.
_GLOO_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_GROUPS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Broadcast:
    """This rank's index and a function that returns rank 0's object on every rank (a collective).

    Attributes:
        rank: This rank (0 computes, the others receive).
        send: ``send(obj)`` returns rank 0's ``obj`` on every rank.
    """

    rank: int
    send: Callable[[Any], Any]


@dataclass(frozen=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None


def job_broadcast() -> Broadcast | None:
    """A broadcast over the job's ``torch.distributed`` group, or ``None`` outside one (or with one rank).

    The default group is used when its backend is gloo; otherwise a gloo group over every rank, created at the
    first call (a collective: every rank must make this call together) and reused for this default group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    group = None if str(dist.get_backend()) == "gloo" else gloo_group()

    def send(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return Broadcast(rank=dist.get_rank(), send=send)


def gloo_group() -> Any:
    import torch.distributed as dist

    world = dist.group.WORLD
    with _GROUPS_LOCK:
        group = _GLOO_GROUPS.get(world)
        if group is None:
            _log.info(
                "creating a gloo group for checkpoint lookups (the default group's backend is %s)", dist.get_backend()
            )
            group = _GLOO_GROUPS[world] = dist.new_group(backend="gloo")
        return group


def lightning_broadcast(trainer: Any) -> Broadcast | None:
    """A broadcast through ``trainer.strategy.broadcast`` (works under every strategy), or ``None`` for one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        # Lightning resolves ckpt_path before it creates the process group (a first fit): its broadcast would then
        # return each rank's own object, so every rank looks by itself, as it must.
        return None
    if getattr(trainer, "world_size", 1) <= 1:
        return None
    return Broadcast(rank=trainer.global_rank, send=lambda obj: trainer.strategy.broadcast(obj, src=0))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (it is sent as it is), else a :class:`StorageError` with its message."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc):
            return exc
    except Exception:  # noqa: BLE001 - not every exception pickles; its text always does
        pass
    return StorageError(f"{type(exc).__name__}: {exc}")


def once(fn: Callable[[], T], *, broadcast: Broadcast | None, doing: str) -> T:
    """Run ``fn`` on rank 0 only and return its result on every rank; raise its error on every rank.

    Args:
        fn: The lookup (reads the store); runs on rank 0, or here without a broadcast.
        broadcast: From :func:`job_broadcast` or :func:`lightning_broadcast`; ``None`` runs ``fn`` here.
        doing: What ``fn`` does, for the note on the other ranks' error.

    Raises:
        Exception: ``fn``'s error, on rank 0 as raised, on the other ranks as a copy of the same type and message
            (an exception that does not pickle arrives as a :class:`StorageError` with its message).
    """
    if broadcast is None:
        return fn()
    outcome = _Outcome()
    if broadcast.rank == 0:
        try:
            outcome = _Outcome(value=fn())
        except Exception as exc:
            outcome = _Outcome(error=_portable(exc))
            broadcast.send(outcome)  # the others raise it too, instead of waiting for a value
            raise
    outcome = broadcast.send(outcome)
    if outcome.error is not None:
        error = outcome.error
        if broadcast.rank != 0:
            error.add_note(f"raised on rank 0 while {doing}; rank {broadcast.rank} read nothing itself")
        raise error
    return outcome.value


def latest_once(store: CheckpointStore, *, verify: bool = True, run_id: str | None = None) -> GenerationInfo | None:
    """``store.latest()`` found and verified on rank 0 only, the answer broadcast to every rank.

    For plain loops and raw FSDP2 under a process group (``ShardedCheckpointer``): every rank calls it together (a
    collective, :func:`job_broadcast`), one reads. Outside a group (or with one rank) it is ``store.latest()``.

    Raises:
        StoreUnavailableError: The store cannot be listed (on every rank).
        StorageError: Generations kept vanishing under rank 0 (on every rank).
    """
    return once(
        lambda: store.latest(verify=verify, run_id=run_id), broadcast=job_broadcast(), doing=f"latest() of {store.uri}"
    )
