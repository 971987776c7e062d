"""The handle of one save (three real futures), and the context-manager behaviour of the checkpointers."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lightning_async_ckpt.core.admission import AdmissionResult
from lightning_async_ckpt.core.capture import CapturePlan, Fence
from lightning_async_ckpt.core.staging import StagingJob
from lightning_async_ckpt.core.telemetry import SaveRecord

__all__ = ["DrainOnExit", "SaveHandle"]


@dataclass(eq=False)
class SaveHandle:
    """One save request, with three real futures.

    Attributes:
        step: The requested step.
        staged: Resolves when the snapshot no longer aliases application memory (the source may mutate).
        uploaded: Resolves when every byte is stored under the store's contract.
        committed: Resolves to the :class:`~lightning_async_ckpt.storage.manifest.Manifest` once it is durably written:
            only then is the generation recoverable. A skipped or coalesced request's futures are cancelled.
        record: Telemetry of this save.
        decision: The admission result (``decision.decision`` is the :class:`AdmissionDecision`).
        plan: The capture plan (``None`` for a request that was not admitted).
    """

    step: int
    record: SaveRecord
    decision: AdmissionResult
    staged: Future = field(default_factory=Future)
    uploaded: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    plan: CapturePlan | None = None
    _job: StagingJob | None = field(default=None, repr=False)

    @property
    def staging(self) -> StagingJob | None:
        """The staging job (its host ``buffers`` and per-fence state); ``None`` when the request was not admitted.

        Read-only view for diagnostics and tests: e.g. whether the buffers are pinned.
        """
        return self._job

    @property
    def outcome(self) -> str:
        """How the save ended so far (the record's :class:`~lightning_async_ckpt.core.telemetry.Outcome`)."""
        return self.record.outcome

    @property
    def done(self) -> bool:
        """Whether the save has ended (committed, failed or cancelled)."""
        return self.committed.done()

    @property
    def blocked_s(self) -> float:
        """Seconds the training thread spent in ``save`` (admission wait and the copy at the cut)."""
        return self.record.blocked_s

    @property
    def sync_bytes(self) -> int:
        """Bytes copied at the cut, on the training thread."""
        return self.record.sync_bytes

    @property
    def deferred_bytes(self) -> int:
        """Bytes staged in the background, behind the fences."""
        return self.record.deferred_bytes

    @property
    def fence_wait_s(self) -> float:
        """Seconds the training thread waited at this save's fences so far."""
        return 0.0 if self._job is None else sum(state.waited_s for state in self._job.fences.values())

    def wait(self, fence: Fence) -> float:
        """Block at ``fence`` until this save's storages fenced there are staged; returns seconds blocked."""
        return self._job.wait(fence) if self._job is not None else 0.0

    def result(self, timeout: float | None = None) -> Any:
        """The committed manifest (raises the save's error)."""
        return self.committed.result(timeout)


class DrainOnExit:
    """Context-manager behaviour shared by the checkpointers: ``close()`` on exit.

    When the body raised, the drain is bounded by ``options.drain_timeout_s`` so the in-flight save lands, and a
    checkpoint error met while unwinding is logged rather than replacing the body's exception.
    """

    options: Any

    def close(self, timeout: float | None = None) -> None:  # pragma: no cover - provided by the subclass
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(timeout=self.options.drain_timeout_s)
        except Exception:  # noqa: BLE001 - the body's exception wins; this one is logged
            logging.getLogger("lightning_async_ckpt").warning("checkpoint error while unwinding", exc_info=True)
