"""Promotion: copy a committed generation from one store to another, verified, with its own manifest last.

:func:`promote_generation` streams each object of a committed source generation once, checked against the source
manifest's size and checksum, through the target's writer, and creates the target manifest exclusively, last; a
failure aborts the target writer (no manifest), and a generation committed on the target already is never
overwritten (:class:`~lightning_async_ckpt.errors.GenerationExistsError`). :class:`Promoter` runs promotions on one
background thread, bounded (``docs/tiers.md``, "What happens").
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import CheckpointError, GenerationExistsError, ManifestError
from lightning_async_ckpt.storage.io import checksum_algorithm, read_verified
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.tiers.background import PromotionQueue, retain_quietly

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = [
    "DURABLE_TIER_KEY",
    "PROMOTED_FROM_KEY",
    "PromotionError",
    "Promoter",
    "copy_objects",
    "promote_generation",
]

_log = logging.getLogger("lightning_async_ckpt")

#: The manifest ``extra`` key a promoted generation records its source in (``{"uri": ..., "step": ...}``).
PROMOTED_FROM_KEY = "promoted_from"
#: The manifest ``extra`` key a local tier's generation records its durable tier's root path in (no protocol: one
#: store named by several URL spellings stays one): the run lineage a resume accepts (:func:`~lightning_async_ckpt.tiers.resume.lineage_filter`).
DURABLE_TIER_KEY = "durable_tier"
#: A durable tier more than this many due generations behind the local one is reported (WARNING, event).
LAG_WARN_GENERATIONS = 2


#: The private prefix of an attempt that wrote beside another attempt's claim (``storage/claims.py``).
_ATTEMPT_PREFIX = re.compile(r"^w-[0-9A-Za-z]+/")


class PromotionError(CheckpointError):
    """A committed generation could not be promoted to the other tier; the target holds no manifest for it."""


def promote_generation(
    source: CheckpointStore,
    target: CheckpointStore,
    step: int,
    *,
    manifest: Manifest | None = None,
) -> Manifest:
    """Copy committed generation ``step`` of ``source`` to ``target`` and commit it there, manifest last.

    Args:
        source: The store holding the committed generation (read only).
        target: Where it is promoted to (written with the target's run id and checksum algorithm).
        step: The generation's step.
        manifest: The source manifest when the caller has just read it.

    Returns:
        The target generation's manifest.

    Raises:
        GenerationExistsError: ``target`` already holds a committed generation ``step`` (never overwritten).
        PromotionError: The source is not committed, an object is damaged (its checksum differs from the source
            manifest's) or unreadable, or the target cannot be written; the target holds no manifest for ``step``.
    """
    try:
        manifest = manifest or source.manifest(step)
    except ManifestError as exc:
        raise PromotionError(f"cannot promote step {step} of {source.uri!r}: {exc}") from exc
    try:
        writer = target.begin(step)  # GenerationExistsError when committed there already: never overwritten
    except GenerationExistsError:
        raise
    except Exception as exc:
        raise PromotionError(f"promoting step {step} to {target.uri!r} failed before any object: {exc}") from exc
    try:
        copy_objects(writer, manifest, lambda obj, stream: _read_source(source, manifest.step, obj, stream))
        extra = {**manifest.extra, PROMOTED_FROM_KEY: {"uri": source.uri, "step": step, "run_id": manifest.run_id}}
        return writer.commit(cut=manifest.cut, plan=manifest.plan, timings=manifest.timings, extra=extra)
    except GenerationExistsError:
        writer.abort()
        raise
    except BaseException as exc:
        writer.abort()
        if isinstance(exc, PromotionError | KeyboardInterrupt | SystemExit):
            raise
        raise PromotionError(
            f"promoting step {step} from {source.uri!r} to {target.uri!r} failed; nothing was committed there: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _read_source(source: CheckpointStore, step: int, obj: Any, stream: Any) -> None:
    # Checks the source bytes against the source manifest as they pass; a mismatch raises after the last chunk,
    # and the stream is then abandoned (never recorded, never committed).
    read_verified(source.fs, f"{source.generation_path(step)}/{obj.key}", obj, into=stream)


def copy_objects(writer: Any, manifest: Manifest, read_into: Callable[[Any, Any], None]) -> None:
    """Write every object of ``manifest`` through ``writer``, each one's bytes from ``read_into(entry, stream)``,
    and check what was written against the manifest's size and checksum (a promotion; a peer replica).

    Raises:
        PromotionError: An object was written with another size or checksum than ``manifest`` says; whatever
            ``read_into`` raises. The caller aborts ``writer`` (nothing is committed).
    """
    for obj in manifest.objects:
        # Where the object sits inside its attempt: a source committed under its own prefix (``w-<token>/``, a
        # writer that found a dead attempt's claim still leased) keeps that prefix to itself; the target attempt
        # has its own.
        key = _ATTEMPT_PREFIX.sub("", obj.key, count=1)
        if key != obj.name:
            writer.place(obj.name, key)
        with writer.open(obj.name) as stream:
            read_into(obj, stream)
        written = {o.name: o for o in writer.objects}[obj.name]
        same_algorithm = checksum_algorithm(written.checksum) == checksum_algorithm(obj.checksum)
        if written.size != obj.size or (same_algorithm and written.checksum != obj.checksum):
            raise PromotionError(
                f"object {obj.name!r} of step {manifest.step}: wrote {written.size} bytes ({written.checksum}), the "
                f"source manifest says {obj.size} bytes ({obj.checksum})"
            )


class Promoter(PromotionQueue):
    """Promotes committed generations of ``source`` to ``target`` on one background thread, and runs retention
    of both tiers.

    :meth:`committed` is told of every generation committed on ``source`` (from any thread: it only records the
    step and applies the source's retention). Generations asked to be promoted are copied one at a time: at most
    one in flight and the newest pending; a newer request replaces a pending one (counted in :attr:`skipped`).
    The newest generation asked to be promoted is never removed from ``source`` by retention before its
    promotion committed (:meth:`protected`).

    Thread-safety: every method may be called from any thread; the copies run on the thread
    ``lightning_async_ckpt-promote``, started at the first request and joined by :meth:`close`.

    Args:
        source: The fast tier, holding committed generations.
        target: The durable tier.
        keep_last: Retention of ``target`` after each promotion (``None``: keep all).
        source_keep_last: Retention of ``source`` after each source commit (``None``: keep all).
        on_error: Receives each promotion failure (on the promotion thread), e.g. to raise it on the training
            thread later.
        on_event: Called with an event name and fields (an ``EventLog.emit``): ``promoted`` (``step``,
            ``promote_s``, ``target``), ``promotion_failed`` (``step``, ``error``), ``promotion_skipped`` (``step``).
        on_commit: Told of each promotion's target manifest, on the promotion thread, right after it was written
            (commit hooks: ``tier="durable"``).
    """

    _thread: threading.Thread | None = None  # started at the first request
    _lag_reported = False

    def committed(self, step: int, *, promote: bool) -> None:
        """Generation ``step`` was committed on ``source``; ``promote`` asks for its promotion."""
        lagging = False
        if promote:
            with self._cond:
                if self._closing:
                    _log.warning("step %d committed on %s after promotions closed: not promoted", step, self.source.uri)
                else:
                    self._mark_due(step)
                    lagging = len(self._due) > LAG_WARN_GENERATIONS and not self._lag_reported
                    self._lag_reported = self._lag_reported or lagging
                    if self._thread is None:
                        self._thread = threading.Thread(
                            target=self._run, name="lightning_async_ckpt-promote", daemon=True
                        )
                        self._thread.start()
                    self._queue(step)
            if lagging:  # outside the lock: a logging handler may be slow
                lag = self.lag
                _log.warning(
                    "the durable tier %s is %d generations behind the local one (newest promoted: step %s): "
                    "promotions take longer than the cadence; raise every_n_train_steps "
                    "or the bandwidth to it",
                    self.target.uri,
                    lag,
                    self.promoted_step,
                )
                self._event("promotion_lagging", step=step, lag=lag)
        self._retain_source()

    def protected(self) -> frozenset[int]:
        """Steps ``source``'s retention must keep: the pending and in-flight promotions, and the newest generation
        asked to be promoted until a promotion at least as new committed."""
        with self._cond:
            steps = {self._pending, self._in_flight, self._newest_due}
            done = self.promoted_step
        return frozenset(s for s in steps if s is not None and (done is None or s > done))

    @property
    def lag(self) -> int:
        """Generations asked to be promoted that are newer than the newest promoted one (in flight, pending, or
        replaced by a newer pending one); above :data:`LAG_WARN_GENERATIONS` it is reported once."""
        with self._cond:
            return len(self._due)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the promotions asked for (within ``timeout``) and stop the thread; idempotent.

        Returns:
            True when every promotion asked for ended (committed or failed) within ``timeout``. Otherwise the
            one in flight keeps running on its (daemon) thread and commits or leaves no manifest; a pending one is
            dropped. Both are logged.
        """
        finished, running = self._stop_queue(timeout)
        if running is not None:
            _log.warning(
                "promotion of step %d to %s still running after %.1fs: it commits or leaves no manifest",
                running,
                self.target.uri,
                timeout or 0.0,
            )
        elif self._thread is not None:
            self._thread.join()
        return finished

    def _run(self) -> None:
        self._serve(self._promote)

    def _promote(self, step: int) -> None:
        started = time.monotonic()
        try:
            manifest = promote_generation(self.source, self.target, step)
        except BaseException as exc:  # noqa: BLE001 - handed to on_error, raised on the training thread
            message = f"promotion of step {step} to {self.target.uri} failed: {exc}"
            self._fail(step, exc, message, f"{type(exc).__name__}: {exc}")
            return
        with self._cond:
            if self.promoted_step is None or manifest.step > self.promoted_step:
                self.promoted_step = manifest.step
            self._due = {s for s in self._due if s > self.promoted_step}
            self._lag_reported = self._lag_reported and len(self._due) > LAG_WARN_GENERATIONS
        _log.info("step %d promoted from %s to %s", step, self.source.uri, self.target.uri)
        if self.on_commit is not None:
            try:
                self.on_commit(manifest)
            except Exception:  # noqa: BLE001 - a hook's bookkeeping never fails a promotion
                _log.warning("commit hooks not told of promoted step %d", step, exc_info=True)
        self._event("promoted", step=step, promote_s=time.monotonic() - started, target=self.target.uri)
        retain_quietly(self.target, self.keep_last)
        self._retain_source()
