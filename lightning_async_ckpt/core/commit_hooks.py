"""After the commit: the record of one committed generation, and the hooks that receive it on the training thread.

The upload or promotion thread queues a :class:`Committed` record right after the manifest was written; the
training thread delivers the records oldest first at its next save, wait, poll or drain, and a callback that raises
is reported once like a failed save. Nothing runs user code on a background thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_async_ckpt.errors import CheckpointError

__all__ = [
    "METRICS_KEY",
    "CommitCallbackError",
    "CommitCallbacks",
    "CommitHooks",
    "Committed",
    "ManifestSummary",
    "check_callable",
]

_log = logging.getLogger("lightning_async_ckpt")
#: ``Manifest.extra`` key of the metrics at the cut (scalars only), carried into :attr:`Committed.metrics`.
METRICS_KEY = "metrics"


class CommitCallbackError(CheckpointError):
    """A commit callback raised; the generation it was told about is committed all the same."""


@dataclass(frozen=True)
class ManifestSummary:
    """What a committed generation's manifest says, in brief.

    Attributes:
        run_id: The run that wrote it.
        total_bytes: Sum of its objects' sizes.
        files: Its objects' names.
        committed_at: Unix time its manifest was written.
        format: ``"torch_save"`` (one stream), ``"torch_dcp"`` (sharded) or another writer's format (an export).
    """

    run_id: str
    total_bytes: int
    files: tuple[str, ...]
    committed_at: float
    format: str


@dataclass(frozen=True)
class Committed:
    """One committed generation, as a commit callback receives it (immutable).

    Attributes:
        step: The cut's global step.
        uri: The generation's folder (URL with protocol for remote stores).
        path: What to load: the checkpoint file for a single-file generation, else :attr:`uri`.
        tier: ``"durable"`` (the store you named; also a promotion's event) or ``"local"`` (a node-local tier's
            commit, promoted later).
        manifest: The manifest in brief.
        is_best: The Lightning callback's ``best_model_path`` names it (``False`` outside Lightning).
        is_last: It is the newest generation committed on its tier when it was delivered.
        metrics: Scalar metrics recorded at the cut (Lightning: the monitor candidates; plain loops: what
            ``extra={"metrics": {...}}`` passed to ``save``).
    """

    step: int
    uri: str
    path: str
    tier: str
    manifest: ManifestSummary
    is_best: bool = False
    is_last: bool = False
    metrics: dict[str, float] = field(default_factory=dict, hash=False)  # a copy of the manifest's: picklable


def summarize(manifest: Any, store: Any, *, tier: str) -> Committed:
    """The :class:`Committed` record of ``manifest`` committed on ``store``."""
    uri = store.url(manifest.step)
    names = tuple(o.name for o in manifest.objects)
    single = len(names) == 1 and manifest.checkpoint_format == "torch_save"
    path = store.url(manifest.step, manifest.objects[0].key) if single else uri
    metrics = manifest.extra.get(METRICS_KEY) if isinstance(manifest.extra, dict) else None
    clean = {str(k): float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)}
    summary = ManifestSummary(
        run_id=manifest.run_id,
        total_bytes=manifest.total_bytes,
        files=names,
        committed_at=manifest.committed_at,
        format=str(manifest.extra.get("format") or "torch_save"),
    )
    return Committed(manifest.step, uri, path, tier, summary, metrics=clean)


class CommitHooks:
    """The commit callbacks of one checkpointer and the records waiting for the training thread.

    :meth:`committed` may be called from any thread; :meth:`deliver` and :meth:`take` from the training thread.
    Records are queued only while someone listens (a callback was added, or :attr:`manual` is set by an
    integration that delivers them itself): a checkpointer without hooks keeps nothing.
    """

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Committed], Any]] = []
        self.manual = False  # the Lightning callback takes the records itself, at its own hooks
        self._queue: deque[Committed] = deque()
        self._newest: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, fn: Callable[[Committed], Any]) -> None:
        """Call ``fn(committed)`` on the training thread once per committed generation (see the module docstring).

        Raises:
            TypeError: ``fn`` is not callable.
        """
        self.callbacks.append(check_callable(fn))

    @property
    def listening(self) -> bool:
        """Whether commits are queued at all."""
        return bool(self.callbacks) or self.manual

    def committed(self, manifest: Any, store: Any, *, tier: str = "durable") -> None:
        """Queue the record of ``manifest``, just committed on ``store`` (any thread; never raises)."""
        if not self.listening:
            return
        record = summarize(manifest, store, tier=tier)
        with self._lock:
            if manifest.step >= self._newest.get(tier, -1):
                self._newest[tier] = manifest.step
            self._queue.append(record)

    def take(self) -> list[Committed]:
        """Remove and return the queued records, oldest first, each with :attr:`Committed.is_last` set."""
        if not self._queue:  # the common case, at every batch end: no lock, no copies (a record queued now waits)
            return []
        with self._lock:
            records, newest = list(self._queue), dict(self._newest)
            self._queue.clear()
        return [replace(r, is_last=r.step == newest.get(r.tier)) for r in records]

    def deliver(self, report: Callable[[BaseException], None]) -> None:
        """Call every callback with every queued record (training thread); each failure goes to ``report`` once."""
        if self.manual or not self._queue:
            return
        for record in self.take():
            for fn in list(self.callbacks):
                call(fn, record, report)


class CommitCallbacks:
    """The engine's commit callbacks (a base of :class:`~lightning_async_ckpt.core.engine.AsyncCheckpointer`): it
    calls :meth:`commit_queued` where a save commits and :meth:`deliver_commits` at its training-thread calls."""

    store: Any
    progress: Any

    def __init__(self) -> None:
        self.commit_hooks = CommitHooks()
        self.commit_tier = "durable"  # "local" when the engine writes a node-local tier (a promotion follows)

    def commit_queued(self, manifest: Any) -> None:
        """Upload thread, right after ``manifest`` was written: queue its record (never raises)."""
        if self.store is not None:
            try:
                self.commit_hooks.committed(manifest, self.store, tier=self.commit_tier)
            except Exception:  # noqa: BLE001 - a hook's bookkeeping never fails a committed save
                _log.warning("commit hooks not told of step %d", manifest.step, exc_info=True)

    def add_commit_callback(self, fn: Callable[[Committed], Any]) -> None:
        """Call ``fn(committed)`` (a frozen :class:`Committed`) once per committed generation, on the training thread
        at the next ``save``/``wait``/``poll``/``drain``/``close``; one that raises is raised once like a failed save
        (``docs/after_commit.md``).

        Raises:
            TypeError: ``fn`` is not callable.
        """
        self.commit_hooks.add(fn)

    def deliver_commits(self) -> None:
        """Run the commit callbacks for the commits queued so far (training thread)."""
        self.commit_hooks.deliver(self.progress.report)


class CommitFanOut:
    """``add_commit_callback`` of an integration that creates its engines lazily (Accelerate's checkpointer): every
    callback goes to each engine it has (``_engines()``) and to each it creates later (:meth:`commit_callbacks_to`)."""

    def _engines(self) -> list[Any]:
        raise NotImplementedError

    def add_commit_callback(self, fn: Callable[[Committed], Any]) -> None:
        """``fn(committed)`` once per generation this process committed, on the training thread at the next step
        fence, save or close (``AsyncCheckpointer.add_commit_callback``; ``docs/after_commit.md``)."""
        self.__dict__.setdefault("_commit_callbacks", []).append(check_callable(fn))
        for engine in self._engines():
            engine.add_commit_callback(fn)

    def commit_callbacks_to(self, engine: Any) -> None:
        """Give a new engine the callbacks added so far."""
        engine.commit_hooks.callbacks.extend(self.__dict__.get("_commit_callbacks", ()))


def check_callable(fn: Any) -> Callable[[Committed], Any]:
    """``fn``, when it is callable; else a ``TypeError`` saying what a commit callback is."""
    if not callable(fn):
        raise TypeError(f"a commit callback must be callable (fn(committed) -> None), got {type(fn).__name__}")
    return fn


def call(fn: Callable[..., Any], record: Committed, report: Callable[[BaseException], None], *args: Any) -> None:
    """Call ``fn(*args, record)``; an exception becomes a :class:`CommitCallbackError` passed to ``report``."""
    try:
        fn(*args, record)
    except Exception as exc:  # noqa: BLE001 - reported like a failed save: raised once at the next hook
        name = getattr(fn, "__qualname__", type(fn).__name__)
        error = CommitCallbackError(
            f"commit callback {name} raised {type(exc).__name__}: {exc} (step {record.step}, tier {record.tier!r}, "
            f"committed at {record.uri}; the checkpoint itself is committed)"
        )
        error.__cause__ = exc
        report(error)
