"""The persist step's input (:class:`PersistWork`) and the persister for one-stream generations.

:class:`StreamPersister` streams the serializer's objects through the I/O thread into a fresh attempt of the
target, with retries, and writes the manifest last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_async_ckpt.core.persist import RetryPolicy, persist
from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.core.telemetry import SaveRecord
from lightning_async_ckpt.core.workers import Worker

if TYPE_CHECKING:
    from lightning_async_ckpt.core.interfaces import SaveTarget

__all__ = ["PersistWork", "StreamPersister"]


@dataclass(eq=False, kw_only=True)
class PersistWork:
    """One staged save handed to a persister (on the engine's upload thread).

    Attributes:
        step: The generation's step.
        state: The state over the staged host buffers (``{}`` when this rank's staging failed).
        job: The staging job (``job.confirm()`` is the guard's last word before anything is published).
        buffers: The staged buffers (a writer may stream views of them without copying).
        record: The save's telemetry record (a persister fills ``upload_s``, ``bytes``, ``commit_s``).
        cut: The manifest's cut metadata.
        plan: The capture plan's summary for the manifest.
        extra: Free-form manifest metadata.
        object_keys: File names for the serializer's objects, by object name.
        objects: More objects to write into the generation (name -> bytes), listed in its manifest.
        abandon: Set when the engine abandons its saves (close timed out): stop without committing.
        uploaded: Call with the ``uploaded`` future's value and the bytes written, once the data is durable.
    """

    step: int
    state: Any
    job: StagingJob
    buffers: list[torch.Tensor]
    record: SaveRecord
    cut: dict[str, Any]
    plan: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    object_keys: Mapping[str, str] = field(default_factory=dict)
    objects: Mapping[str, bytes] = field(default_factory=dict)
    abandon: threading.Event = field(default_factory=threading.Event)
    uploaded: Callable[[Any, int], None] = lambda value, nbytes: None


class StreamPersister:
    """Persists a generation written by this process alone: serializer objects, then the manifest last.

    Args:
        target: Where generations go (a :class:`~lightning_async_ckpt.storage.store.CheckpointStore` or another
            :class:`~lightning_async_ckpt.core.interfaces.SaveTarget`).
        serializer: Writes the staged state as objects (``torch.save`` by default).
        retry: Which failures are retried, and when.
        io: The I/O worker every object stream writes on.
        on_retry: Called with the attempt number and the error before each retry.
    """

    collective = False  # staging failed: nothing to write, the save fails on this process alone
    coordinator = True  # this process runs retention after its commits

    def __init__(
        self,
        target: SaveTarget,
        serializer: Any,
        retry: RetryPolicy,
        io: Worker,
        on_retry: Callable[[int, int, BaseException], None] = lambda step, attempt, exc: None,
    ) -> None:
        self.target = target
        self.serializer = serializer
        self.retry = retry
        self.io = io
        self.on_retry = on_retry

    def persist(self, work: PersistWork) -> Any:
        """Write ``work`` as one generation with retries; returns the committed manifest."""
        record = work.record

        def write(state: Any, writer: Any) -> None:
            self.serializer.write(state, writer)
            for name, data in work.objects.items():
                with writer.open(name) as stream:
                    stream.write(data)

        def commit(writer: Any) -> Any:
            work.job.confirm()  # the guard's last word before the manifest: a write before a fence refuses it
            timings = {"blocked_s": record.blocked_s, "staging_s": record.staging_s, "upload_s": record.upload_s}
            return writer.commit(cut=work.cut, plan=work.plan, timings=timings, extra=work.extra)

        return persist(
            store=self.target,
            serializer=_Writes(write),
            step=work.step,
            state=work.state,
            record=record,
            policy=self.retry,
            io=self.io,
            abandon=work.abandon,
            buffers=work.buffers,
            on_uploaded=lambda nbytes: work.uploaded(nbytes, nbytes),
            commit=commit,
            on_retry=lambda attempt, exc: self.on_retry(work.step, attempt, exc),
            object_keys=work.object_keys,
            checksums=work.job.staged_checksums(),
        )

    def close(self) -> None:
        """Nothing to release: the engine owns the threads."""


@dataclass(frozen=True)
class _Writes:
    write: Callable[[Any, Any], None]
