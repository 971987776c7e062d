"""The asynchronous checkpoint engine: ``save``, ``wait``, ``drain`` and ``close``; each role lives in its module.

Pipeline of one request::

    save(step, state) -> admission (admission.py) -> capture plan + copy at the cut (the capturer: capturer.py)
        -> staging thread (fenced) -> staged -> upload thread: the persister writes the objects (a torch.save
        stream: stream_persister.py; DCP files on every rank: sharded/persister.py) -> uploaded
        -> manifest last -> the commit target (retention; with tiers the promotion and the replicas) -> committed

The one save lifecycle of the package: every integration drives this class; only the capturer and the persister
differ (``core.interfaces.Capturer`` / ``Persister``). Threads: ``workers.py``; fences: ``hooks.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_async_ckpt.core.admission import Admission, AdmissionDecision
from lightning_async_ckpt.core.capture import DeferralProof, Fence
from lightning_async_ckpt.core.capturer import PlainCapturer
from lightning_async_ckpt.core.commit_hooks import CommitCallbacks
from lightning_async_ckpt.core.commit_target import StoreTarget, emergency_save, time_left
from lightning_async_ckpt.core.completion import Completion, Progress, ProgressView
from lightning_async_ckpt.core.handle import DrainOnExit, SaveHandle
from lightning_async_ckpt.core.hooks import FenceHooks
from lightning_async_ckpt.core.in_flight import InFlight
from lightning_async_ckpt.core.interfaces import Capturer, CommitTarget, Persister
from lightning_async_ckpt.core.lifecycle import Lifecycle
from lightning_async_ckpt.core.options import CheckpointOptions, Serializer, TorchSaveSerializer
from lightning_async_ckpt.core.persist import RetryPolicy
from lightning_async_ckpt.core.proof import FINAL_PROOF
from lightning_async_ckpt.core.staging import BufferPool, resolve_budget
from lightning_async_ckpt.core.stream_persister import StreamPersister
from lightning_async_ckpt.core.telemetry import EventLog, Outcome, SaveRecord, StepClock
from lightning_async_ckpt.errors import CheckpointError, ConfigError
from lightning_async_ckpt.storage import inflight
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["AsyncCheckpointer", "CheckpointOptions", "SaveHandle", "Serializer", "TorchSaveSerializer"]

_log = logging.getLogger("lightning_async_ckpt")


class AsyncCheckpointer(ProgressView, CommitCallbacks, Lifecycle, DrainOnExit):
    """Framework-free asynchronous checkpointing into a :class:`CheckpointStore`.

    Thread-safety: ``save``, ``wait``, ``poll``, ``drain`` and ``close`` are called from one training thread; the
    engine's own work runs on named threads (``lightning_async_ckpt-stage``, ``-upload`` and ``-io``), created
    lazily. Background errors are re-raised on the training thread at the next ``save``/``wait``/``poll``/
    ``drain``, each exactly once, oldest first.

    Args:
        store: Where generations go (or a URL to open one); ``None`` only with a ``persister`` that writes elsewhere
            (the CheckpointIO plugin writes the paths Lightning names).
        options: Engine settings; keyword arguments override its fields.
        persister: How a staged save is written (default: a :class:`StreamPersister` of ``options.serializer``
            into ``store``; the sharded checkpointer passes its DCP persister).
        capturer: How a cut is captured (default: :class:`PlainCapturer`; the sharded checkpointer captures DTensors
            through their local shards).
        target: Where each commit goes next (``CommitTarget``; default: ``store``'s retention by ``keep_last``; tiers
            pass a ``TieredTarget``); :meth:`drain` and :meth:`close` reach it.
        **overrides: Any :class:`CheckpointOptions` field.

    Example::

        with AsyncCheckpointer(CheckpointStore("/tmp/ckpt"), keep_last=2) as ckpt:
            ckpt.attach(model, optimizer)
            for step in range(100):
                train_step()
                if step % 10 == 0:
                    ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
    """

    writes_dcp = False  # one torch.save stream per generation (core.interfaces.TrainingCheckpointer)

    def __init__(
        self,
        store: CheckpointStore | str | None,
        options: CheckpointOptions | None = None,
        *,
        persister: Persister | None = None,
        capturer: Capturer | None = None,
        target: CommitTarget | None = None,
        **overrides: Any,
    ) -> None:
        if isinstance(store, str):
            store = CheckpointStore(store)
        if not isinstance(store, CheckpointStore) and not (store is None and persister is not None):
            raise ConfigError(f"store must be a CheckpointStore or a URL string, got {type(store).__name__}")
        if options is not None and not isinstance(options, CheckpointOptions):
            raise ConfigError(f"options must be a CheckpointOptions or None, got {type(options).__name__}")
        if options is None or overrides:
            options = CheckpointOptions(**{**(options.__dict__ if options else {}), **overrides})
        self.store = store
        self.options = options
        self.serializer: Serializer = options.serializer or TorchSaveSerializer()
        self.retry = RetryPolicy(retries=options.retries, backoff_s=options.retry_backoff_s)
        self.pool = BufferPool(resolve_budget(options.host_memory_budget, options.reserved_host_bytes))
        self.events = EventLog(options.event_log)
        self.admission = Admission(max_outstanding=options.max_outstanding, policy=options.admission)
        self._fence_hooks = FenceHooks(lambda fence: self.wait(fence))  # late-bound: wait may be wrapped
        self.in_flight = InFlight()
        self.step_clock = StepClock()  # what the steps feel around saves (ticks at each batch-start fence)
        self._reserve_seen = (False, 0)  # the pool's (reserving, reservations) at the last tick
        self._cut_since_tick = False
        self.progress = Progress(options.on_error)  # committed step, records, refusals, the error queue
        self.requested_step: int | None = None
        CommitCallbacks.__init__(self)  # add_commit_callback: records queued at each commit, run at the next call
        Lifecycle.__init__(self, upload_nice=options.upload_nice)
        self.capturer: Capturer = capturer or PlainCapturer()
        self.persister: Persister = persister or StreamPersister(
            store,
            self.serializer,
            self.retry,
            self.io_worker,
            on_retry=lambda step, attempt, exc: self.events.emit("retry", step=step, attempt=attempt, error=str(exc)),
        )
        self.target: CommitTarget = target or StoreTarget(lambda: self.store, options.keep_last, self.events.emit)
        self.newest_save: SaveHandle | None = None  # the emergency save promotes it when it is of its step
        self.completion = Completion(
            persister=self.persister,
            pool=self.pool,
            events=self.events,
            progress=self.progress,
            abandoning=self.abandoning,
            target=self.target if target is not None or self.persister.coordinator else None,
            on_commit=self.commit_queued,
        )

    # -- saving ------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        modules: Sequence[torch.nn.Module] = (),
        optimizers: Sequence[Any] = (),
        proof: DeferralProof | None = None,
        defer: bool = True,
        cut: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        admission: str | None = None,
        object_keys: dict[str, str] | None = None,
        objects: dict[str, bytes] | None = None,
        final: bool = False,
        durable: bool | None = None,
        promote: bool | None = None,
    ) -> SaveHandle:
        """Request a checkpoint of ``state`` at the cut ``step``.

        The call returns once the cut is captured: Python objects deep-copied, copy-at-cut tensors copied,
        deferred tensors fingerprinted. Deferred tensors are staged in the background; the caller must call
        :meth:`wait` at their fences (``attach`` does that in plain loops).

        Args:
            step: The cut's global step (one generation per step).
            state: Nested dicts/lists/tuples of tensors and Python objects; tensors may alias live memory.
            modules: Modules whose parameters/buffers appear in ``state`` (for classification).
            optimizers: Optimizers whose state appears in ``state``.
            proof: Deferral proof; default: proven from ``modules``/``optimizers`` and the fences this checkpointer
                knows the caller calls (see :meth:`attach`).
            defer: ``False`` copies everything at the cut.
            cut: Extra cut metadata for the manifest (epoch, ...).
            extra: Free-form JSON metadata for the manifest.
            admission: Policy for this request only (e.g. ``"wait"`` for a final checkpoint that must not be
                skipped); default: the configured one.
            object_keys: File names for the serializer's objects, by object name (e.g. ``{"checkpoint.ckpt":
                "epoch=2-step=24.ckpt"}``); the manifest records each as the object's path.
            objects: More objects written into the generation (name -> bytes, e.g. Lightning's ``meta.pt`` beside
                DCP files), listed in the manifest like the others.
            final: The checkpoint that ends training: copied at the cut (no deferral: nothing follows to overlap
                with, and code after the loop cannot reach it, so the guard can never refuse it) and admitted with
                ``"wait"`` unless ``admission`` says otherwise.
            durable: With tiers: whether the generation goes to the durable tier too (``None``: the target's
                cadence); a plain store ignores it.
            promote: The tiers' name for ``durable`` (give one of them).

        Returns:
            The save's handle; for a skipped or coalesced request its futures are cancelled.

        Raises:
            AdmissionError: ``admission="abort"`` and the outstanding limit is reached (recorded as ``aborted``).
            CheckpointError: A previous save failed in the background (raised once).
            ConfigError: A bad argument, or a rank that must not save (it only receives peer replicas).
        """
        if self.closed:
            raise CheckpointError("this AsyncCheckpointer is closed; create a new one to keep saving")
        self.target.check_save()
        if promote is not None and durable not in (None, promote):
            raise ConfigError(f"durable={durable!r} and promote={promote!r} disagree: give only one of them")
        durable = promote if promote is not None else durable
        extra = {**self.target.manifest_extra(), **(extra or {})}
        self.in_flight.observe_staged()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        self.deliver_commits()
        self.raise_pending()
        if final:
            defer, proof, admission = False, FINAL_PROOF, admission or "wait"
        t0 = time.perf_counter()
        record = SaveRecord(requested_step=step)
        decision = self.admission.decide(
            step,
            policy=admission,
            backlog=lambda: self.outstanding,
            wait_one=self.in_flight.wait_oldest,
            committed_step=lambda: self.committed_step,
        )
        if decision.decision is AdmissionDecision.ABORT:
            self.completion.refused(record, decision)
            raise self.admission.refusal(decision)
        if decision.decision is AdmissionDecision.WAIT:
            self.raise_pending()
        record.decision, record.backlog = decision.decision, decision.backlog
        record.admission_wait_s = decision.waited_s
        self.requested_step = step
        self.completion.requested(record, decision)
        handle = SaveHandle(step=step, record=record, decision=decision)
        self.newest_save = handle
        if not decision.admitted:
            record.outcome = Outcome.COALESCED if decision.decision is AdmissionDecision.COALESCE else Outcome.SKIPPED
            record.committed_step = self.committed_step
            for fut in (handle.staged, handle.uploaded, handle.committed):
                fut.cancel()
            self.completion.finish_record(record)
            return handle
        self.progress.torn_step = None
        try:
            capture = self.capturer.capture(
                state, modules=modules, optimizers=optimizers, proof=proof, defer=defer,
                fences=self._fence_hooks.fences, demoted=self.progress.demoted, pool=self.pool,
                guard=self.options.guard,
            )  # fmt: skip
            capture.job.abandon, capture.job.huge_pages = self.abandoning, self.options.huge_pages
        except BaseException as exc:
            # Admitted but never started: the request still ends with a record.
            record.outcome, record.error = Outcome.FAILED, f"{type(exc).__name__}: {exc}"
            record.committed_step, record.blocked_s = self.committed_step, time.perf_counter() - t0
            self.completion.finish_record(record)
            raise
        plan, job = capture.plan, capture.job
        handle.plan, handle._job = plan, job
        record.sync_bytes = plan.total_bytes - job.deferred_bytes
        record.deferred_bytes = job.deferred_bytes
        record.blocked_s = time.perf_counter() - t0
        record.mark("cut", record.t_request)
        cut_meta = {"step": step, "requested_at": record.t_request, **(cut or {})}
        self.in_flight.add(handle)
        self._cut_since_tick = True
        if self.store is not None:  # readers in this process wait for it (storage/inflight)
            inflight.track(self.store, step, handle.committed)
        self.stage_worker.submit(job.run)
        keys, more = dict(object_keys or {}), dict(objects or {})
        self.upload_worker.submit(
            lambda: self.completion.run(handle, capture, cut_meta, extra, keys, more, durable=durable)
        )
        return handle

    @property
    def outstanding(self) -> int:
        """Saves admitted and not yet ended."""
        return self.in_flight.count()

    @property
    def coalesce_due(self) -> bool:
        """True when a coalesced request is waiting and the backlog has drained: take a fresh cut now."""
        return self.admission.coalesce_due(self.outstanding)

    @property
    def retake_due(self) -> bool:
        """True when the newest admitted save was refused as torn (the guard tripped): take a fresh cut now.

        The torn categories are already demoted to copy-at-cut, so the retake cannot tear the same way. Cleared by
        the next admitted :meth:`save`.
        """
        return self.torn_step is not None

    @property
    def pending_coalesce(self) -> int | None:
        """The step of a coalesced request still waiting for its fresh cut."""
        return self.admission.pending_coalesce

    @property
    def skipped(self) -> int:
        """Requests dropped by admission (skipped or coalesced)."""
        return self.admission.skipped

    # -- training-thread calls ---------------------------------------------------------------------------
    def wait(self, fence: Fence, *, raise_errors: bool = True) -> float:
        """Block at ``fence`` until every outstanding save's storages fenced there are staged.

        Cheap when nothing is outstanding; call it right before the first mutation of the fenced categories. A
        wait that blocked is recorded in the saves' records and emitted as a ``fence_wait`` event.

        Args:
            fence: The fence being passed.
            raise_errors: Re-raise a pending background error here (multi-process callers raise them only at
                collective points instead).

        Returns:
            Seconds blocked.
        """
        if fence is Fence.BATCH_START:  # once per step: the period since the last one, for StepClock
            running = self.in_flight.running_records()  # most steps have none: no lock, no list
            # The pool's fill ahead of the first cut ran at the period's start or end, or began within it.
            reserving, begun = self.pool.reserving, self.pool.reservations
            background = reserving or self._reserve_seen[0] or begun != self._reserve_seen[1]
            self._reserve_seen = (reserving, begun)
            self.step_clock.tick(time.perf_counter(), running, started=self._cut_since_tick, background=background)
            self._cut_since_tick = False
        self.deliver_commits()
        if raise_errors:
            self.raise_pending()
        if not self.in_flight:
            return 0.0
        waited, steps = self.in_flight.wait_at(fence)
        if steps:
            self.events.emit("fence_wait", fence=fence.value, wait_s=waited, steps=steps)
        return waited

    def poll(self) -> None:
        """Raise a pending background error, if any."""
        self.in_flight.observe_staged()
        self.in_flight.reap()
        self.deliver_commits()
        self.raise_pending()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every outstanding save ended and the target finished what the commits handed to it (promotions
        due, replicas); re-raise a background error. Whether everything ended within ``timeout``."""
        self.in_flight.observe_staged()
        deadline = None if timeout is None else time.monotonic() + timeout
        saved = self.drain_quietly(timeout)
        handed = self.target.drain(time_left(deadline))
        self.deliver_commits()
        self.raise_pending()
        return saved and handed

    def drain_quietly(self, timeout: float | None) -> bool:
        """Wait until every outstanding save ended, its commit handed to the target (not the promotion nor the
        replicas: :meth:`drain`); never raises (pending errors stay pending). Whether they all ended in time."""
        return self.in_flight.drain(timeout)

    def emergency_save(self, step: int, state: Any, *, grace_s: float | None = None, **kwargs: Any) -> str:
        """The save before the process goes away: the newest save made durable when it is of ``step``, else
        ``state`` saved copied at the cut and durable (``None``: the caller cut already; ``kwargs``: more
        :meth:`save` arguments); the commit, the promotion and the replicas drained within ``grace_s``. Returns
        what is where (also logged at WARNING)."""
        return emergency_save(self, step, state, grace_s, kwargs)

    def in_flight_steps(self) -> list[int]:
        """Steps of the saves admitted and not yet ended, oldest first."""
        return self.in_flight.steps()

    # -- plain PyTorch loops -----------------------------------------------------------------------------
    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
    ) -> AsyncCheckpointer:
        """Install the fences for a plain loop: an optimizer step pre-hook and a forward pre-hook.

        Afterwards ``save(..., modules=[model], optimizers=[optimizer])`` defers what the proof allows, without
        other code changes. :meth:`detach` removes the hooks.

        Returns:
            This checkpointer, so ``ckpt = AsyncCheckpointer(store).attach(model, optimizer)`` works.
        """
        self._fence_hooks.attach(model, optimizer)
        self.capturer.bind([model], [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer))
        return self

    def detach(self) -> None:
        """Remove the hooks installed by :meth:`attach` (after waiting at every fence)."""
        self.wait(Fence.OPTIMIZER_STEP)
        self._fence_hooks.remove()

    def declare_fences(
        self, fences: Iterable[Fence], *, modules: Sequence[Any] = (), optimizers: Sequence[Any] = ()
    ) -> None:
        """Tell the engine which fences the caller calls (integrations that install their own hooks).

        Args:
            fences: The fences the caller passes itself (calling :meth:`wait`).
            modules: The modules a save's state comes from, for capturers that classify without being told at
                each save (the sharded one); the plain capturer classifies what each ``save`` names.
            optimizers: Their optimizers, likewise.
        """
        self._fence_hooks.declare(fences)
        if modules or optimizers:
            self.capturer.bind(list(modules), list(optimizers))

    def _remove_hooks(self) -> None:
        self._fence_hooks.remove()
