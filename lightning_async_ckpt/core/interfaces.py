"""The declared interfaces around the pipeline: what a training integration drives, and where a save writes.

Two seams used to be duck-typed (the callback told its checkpointers apart with ``isinstance``; the engine took
``store: Any``). They are declared here as :class:`typing.Protocol` classes, so a reader finds every method a
seam needs in one place and a type checker holds each implementation to it:

* :class:`TrainingCheckpointer`: what ``AsyncCheckpointCallback`` drives on each rank. Implemented by the
  single-writer engine (:class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`, one ``torch.save`` stream per
  generation) and by the sharded adapter (``lightning.sharded.ShardedCallbackCheckpointer``, DCP files on every
  rank); :attr:`TrainingCheckpointer.writes_dcp` is the one difference the callback asks about.
* :class:`Capturer` and :class:`Persister`: the two parts of the engine's one lifecycle that differ by layout. The
  engine (admission -> capture -> staging + guard -> persist -> commit -> retention) is written once; a plain or a
  sharded capturer sees the tensors, a stream or a DCP persister writes the generation.
* :class:`SaveTarget` and :class:`GenerationSink`: where the persist step writes one attempt of a generation.
  Implemented by :class:`~lightning_async_ckpt.storage.store.CheckpointStore` /
  :class:`~lightning_async_ckpt.storage.writer.GenerationWriter` and by Accelerate's folder store.
* :class:`CommitTarget`: where a committed generation goes next (retention of a plain store; the durable tier and
  the peer replicas of :class:`~lightning_async_ckpt.tiers.target.TieredTarget`).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from lightning_async_ckpt.core.capture import Fence

__all__ = [
    "Capturer",
    "CommitTarget",
    "GenerationSink",
    "Persister",
    "SaveTarget",
    "TrainingCheckpointer",
    "TrainingSaveHandle",
]


class TrainingSaveHandle(Protocol):
    """What the callback reads of one save: the admission decision and the ``committed`` future."""

    decision: Any
    committed: Future


@runtime_checkable
class TrainingCheckpointer(Protocol):
    """What a training integration drives on one rank, whatever persists the state.

    Call sequence (the Lightning callback's; plain loops use a subset):

    0. :meth:`declare_fences` once, with the fences the integration will call :meth:`wait` at;
    1. at each fence, :meth:`wait` (errors deferred to a collective point with ``raise_errors=False``);
    2. at a cut, :meth:`save` with the state and the capture arguments; it returns a :class:`TrainingSaveHandle`;
    3. at collective points, :meth:`take_pending_error` (an ended save's failure, once);
    4. at the end, :meth:`drain_quietly` (before the final retake check), then :meth:`close`.

    Progress the integration reads between calls: :attr:`committed_step`, :attr:`outstanding`,
    :attr:`retake_due` (the guard refused the newest save), :attr:`coalesce_due`, :attr:`closed`.
    """

    writes_dcp: bool
    """``True`` when a generation is a DCP folder written by every rank; ``False`` for one ``torch.save`` object."""

    committed_step: int | None
    pool: Any
    events: Any

    @property
    def closed(self) -> bool: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def retake_due(self) -> bool: ...

    @property
    def coalesce_due(self) -> bool: ...

    def declare_fences(self, fences: Iterable[Fence]) -> None: ...

    def wait(self, fence: Fence, *, raise_errors: bool = True) -> Any: ...

    def save(self, step: int, state: Any, **capture: Any) -> TrainingSaveHandle: ...

    def take_pending_error(self) -> BaseException | None: ...

    def drain_quietly(self, timeout: float | None) -> bool: ...

    def close(self, timeout: float | None = None) -> Any: ...

    def preallocate(self, state: Any, **kwargs: Any) -> Any: ...


class GenerationSink(Protocol):
    """One attempt of one generation being written (a :class:`~lightning_async_ckpt.storage.writer.GenerationWriter`).

    Call sequence: :meth:`place` for objects written under another key (optional), :meth:`open` per object (each
    stream closed before the next), then exactly one of ``commit`` (by the completion step, manifest last) or
    :meth:`abort`.
    """

    @property
    def objects(self) -> list[Any]: ...

    def place(self, name: str, key: str) -> None: ...

    def open(self, name: str) -> Any: ...

    def abort(self) -> None: ...


@runtime_checkable
class SaveTarget(Protocol):
    """Where the persist step writes generations (a :class:`~lightning_async_ckpt.storage.store.CheckpointStore`).

    :meth:`begin` starts one attempt; :meth:`manifest` and :meth:`check_sizes` let a retry recognise its own
    earlier commit whose acknowledgement was lost; :meth:`gc` is retention after a commit.
    """

    run_id: str

    def begin(self, step: int) -> GenerationSink: ...

    def manifest(self, step: int) -> Any: ...

    def check_sizes(self, manifest: Any) -> list[str]: ...

    def gc(self, keep_last: int, **kwargs: Any) -> list[int]: ...


class Capturer(Protocol):
    """How the engine captures a cut on the training thread (one per engine).

    Call sequence: :meth:`bind` whenever the caller names its modules and optimizers (``attach``,
    ``declare_fences``); :meth:`capture` at every admitted cut, returning an object with ``plan``, ``job``,
    ``buffers`` and ``staged_state()`` (:class:`~lightning_async_ckpt.core.capturer.CutCapture`).
    Implemented by :class:`~lightning_async_ckpt.core.capturer.PlainCapturer` and the sharded capturer.
    """

    def bind(self, modules: Any, optimizers: Any) -> None: ...

    def capture(self, state: Any, **how: Any) -> Any: ...


class Persister(Protocol):
    """How a staged save becomes a committed generation (runs on the engine's upload thread).

    Call sequence: once per admitted save, after its staging ended, the engine calls :meth:`persist` with a
    :class:`~lightning_async_ckpt.core.stream_persister.PersistWork`; it returns the committed manifest (or
    ``None`` when the commit happened elsewhere and could not be read back) or raises, and the engine turns the
    outcome into the save's futures, record and error queue; :meth:`close` once at the end. A :attr:`collective`
    persister is called even when this rank's staging failed (its collectives must fail the save on every rank
    rather than leave the others waiting); :attr:`coordinator` says whether this process runs retention.
    Implemented by :class:`~lightning_async_ckpt.core.stream_persister.StreamPersister` (one writer) and
    :class:`~lightning_async_ckpt.sharded.persister.DcpPersister` (every rank writes DCP files).
    """

    collective: bool
    coordinator: bool

    def persist(self, work: Any) -> Any: ...

    def close(self) -> None: ...


class CommitTarget(Protocol):
    """Where a committed generation goes next: the engine's only view of what follows a commit.

    Call sequence: :meth:`check_save` on the training thread at each ``save``; :meth:`committed` on the engine's upload thread after each manifest this process committed and
    before that save's ``committed`` future resolves (so the engine's own drain covers the hand-over);
    :meth:`make_durable` on the training thread (the emergency save right after a local cut of the same step);
    :meth:`drain` and :meth:`close` after the engine's saves ended; :meth:`report` for the emergency save's line.
    Implemented by :class:`~lightning_async_ckpt.core.commit_target.StoreTarget` (a plain store: retention) and
    :class:`~lightning_async_ckpt.tiers.target.TieredTarget` (a local and a durable tier, peer replicas).
    """

    def check_save(self) -> None:
        """Raise :class:`~lightning_async_ckpt.errors.ConfigError` when this process must not save (a rank that only
        receives peer replicas); called first by every ``save``."""

    def manifest_extra(self) -> dict[str, Any]:
        """What each save's manifest records about this target (merged under the caller's ``extra``)."""

    def committed(self, step: int, durable: bool | None) -> None:
        """Generation ``step`` committed; ``durable`` asks for it on the durable tier (``None``: the cadence)."""

    def make_durable(self, step: int) -> bool:
        """Make the committed (or committing) newest generation ``step`` due on the durable tier; whether it is."""

    def drain(self, timeout: float | None) -> bool:
        """Wait for the work the commits handed over; whether it ended within ``timeout``."""

    def close(self, timeout: float | None) -> None:
        """Drain within ``timeout`` and stop the threads."""

    def report(self, step: int) -> str:
        """What is where beyond the engine's own store (``"; promoted step ..."``), for the emergency line."""
