"""Promotion of sharded (DCP) local generations to the durable store: every rank uploads its own files.

Each rank's local generation (:mod:`.local_tier`) holds only that rank's files, so a promotion is collective: on
the thread ``lightning_async_ckpt-promote-dcp`` of every rank, over a gloo group of its own, one round::

    rank 0 broadcasts the step -> all_gather(every rank holds it committed locally) -> rank 0 claims the durable
    step, broadcasts token and prefix -> every rank streams its local objects into the durable generation (verified,
    under the attempt's token and lease) -> all_gather(entries, local path -> durable path) -> rank 0 rewrites the
    global metadata's file paths, writes ``.metadata`` and the manifest last -> broadcast(outcome); a failed round
    removes every rank's uploads.

A rank killed mid-round leaves uploads without a manifest (never listed); the survivors' collectives fail and the
promoter stops (its error raised once at the next hook). A stalled promoter writes only its own token's names, and
its commit loses to a committed manifest. Bounded like :class:`~lightning_async_ckpt.tiers.promote.Promoter`.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_async_ckpt.errors import GenerationExistsError
from lightning_async_ckpt.sharded.commit import DCP_FORMAT
from lightning_async_ckpt.sharded.dcp_files import StoreFileSystem
from lightning_async_ckpt.sharded.dcp_writer import METADATA_NAME
from lightning_async_ckpt.storage.claims import Lease, attempt_claim_name
from lightning_async_ckpt.storage.dcp_metadata import load_metadata
from lightning_async_ckpt.storage.io import read_verified
from lightning_async_ckpt.storage.manifest import Manifest, ObjectEntry
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.storage.verification import object_path
from lightning_async_ckpt.tiers.background import PromotionQueue, from_first, gather, retain_quietly
from lightning_async_ckpt.tiers.local_tier import GLOBAL_METADATA_NAME
from lightning_async_ckpt.tiers.promote import PROMOTED_FROM_KEY, PromotionError

__all__ = ["DcpPromoter"]

_log = logging.getLogger("lightning_async_ckpt")
_DATA_RE = re.compile(r"^__[0-9]+_[0-9]+\.distcp$")


class DcpPromoter(PromotionQueue):
    """Promotes committed local sharded generations to ``durable`` on every rank together (module docstring).

    Construct on every rank in the same order (creates a gloo group: a collective). :meth:`committed` is told of
    every local commit on every rank (the same steps, the same ``promote``); rank 0 decides which step each round
    promotes. Thread-safety: every method may be called from any thread.

    Args:
        local: This rank's local store (its generations hold this rank's files).
        durable: The durable store (the same on every rank).
        keep_last: Durable retention after each promotion (rank 0).
        local_keep_last: Local retention after each local commit and promotion (every rank, its own store).
        timeout_s: The promotion group's collective timeout.
        on_error: Receives each promotion failure (on the promotion thread; on every rank).
        on_event: ``promoted`` / ``promotion_failed`` / ``promotion_skipped`` events (an ``EventLog.emit``).
    """

    def __init__(
        self,
        local: CheckpointStore,
        durable: CheckpointStore,
        *,
        keep_last: int | None = None,
        local_keep_last: int | None = None,
        timeout_s: float = 300.0,
        on_error: Callable[[BaseException], None] | None = None,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        # ``source``/``target`` are ``local``/``durable``; on_commit is told of each durable manifest on rank 0.
        super().__init__(
            local, durable, keep_last=keep_last, source_keep_last=local_keep_last, on_error=on_error, on_event=on_event
        )
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if distributed else None
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.broken: BaseException | None = None
        self._last_round: int | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="lightning_async_ckpt-promote-dcp", daemon=True)
        self._thread.start()

    # -- the training side ------------------------------------------------------------------------------------
    def committed(self, step: int, *, promote: bool) -> None:
        """Local generation ``step`` was committed on every rank; ``promote`` asks for its promotion."""
        if promote:
            with self._cond:
                self._mark_due(step)
                if self._stopped or self._closing:
                    _log.warning(
                        "step %d committed on %s after promotions stopped: not promoted", step, self.source.uri
                    )
                elif self.rank == 0:
                    self._queue(step)
        self._retain_source()

    def protected(self) -> frozenset[int]:
        """Local steps retention keeps: due steps newer than the last round, the one in flight, and the newest due
        step until a promotion at least as new committed."""
        with self._cond:
            last, done = self._last_round, self.promoted_step
            steps = {s for s in self._due if last is None or s > last}
            steps |= {s for s in (self._in_flight, self._pending) if s is not None}
            if self._newest_due is not None and (done is None or self._newest_due > done):
                steps.add(self._newest_due)
        return frozenset(steps)

    def _working(self) -> bool:
        # :meth:`drain` waits for it: rank 0 has the due step pending or in flight; another rank waits for rank 0's
        # round of its newest due step (rank 0 decides which; the others follow its rounds).
        behind = self._newest_due is not None and (self._last_round is None or self._newest_due > self._last_round)
        return not self._stopped and (super()._working() or behind)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the promotions asked for (within ``timeout``), stop every rank's thread; call on every rank."""
        finished, _ = self._stop_queue(timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            _log.warning(
                "the promotion thread of %s is still running: it commits or leaves no manifest", self.source.uri
            )
            return False
        if self.group is not None and self.broken is None:
            dist.destroy_process_group(self.group)
            self.group = None
        return finished

    # -- the promotion thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        step = None
        try:
            while True:
                step = None
                if self.rank == 0:
                    with self._cond:
                        while self._pending is None and not self._closing:
                            self._cond.wait()
                        step, self._pending = self._pending, None
                        self._in_flight = step
                step = from_first(self.group, step)
                if step is None:
                    return
                with self._cond:
                    self._in_flight = step
                self._round(step)
                with self._cond:
                    self._in_flight = None
                    self._last_round = max(step, self._last_round or step)
                    self._due = {s for s in self._due if s > self._last_round}
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - a broken group (dead peer, timeout): promotions stop
            # Reported before a waiter can see the round end, so a drain that returns raises it.
            self.broken = exc
            self._fail_round(step, PromotionError(f"promotions to {self.target.uri!r} stopped: {exc}"))
        finally:
            with self._cond:
                self._stopped = True
                self._pending = self._in_flight = None
                self._cond.notify_all()

    def _round(self, step: int) -> None:
        started = time.monotonic()
        try:
            manifest: Manifest | None = self.source.manifest(step)
            problem = None
        except Exception as exc:  # noqa: BLE001 - gathered: every rank learns which rank lacks it
            manifest, problem = None, f"rank {self.rank}: {type(exc).__name__}: {exc}"
        problems = [p for p in gather(self.group, problem) if p is not None]
        if problems:
            self._fail_round(
                step, PromotionError(f"step {step} not promoted: not committed locally on " + "; ".join(problems))
            )
            return
        assert manifest is not None
        claim = None
        start: tuple[Any, ...]
        if self.rank == 0:
            try:
                claim = self.target.begin(step)
                start = ("go", claim.token, claim.prefix)
            except GenerationExistsError:
                start = ("exists",)
            except Exception as exc:  # noqa: BLE001 - broadcast: every rank skips this round
                start = ("error", f"{type(exc).__name__}: {exc}")
        start = from_first(self.group, start if self.rank == 0 else None)
        if start[0] != "go":
            if start[0] == "exists":
                _log.info("step %d is committed on %s already: not promoted again", step, self.target.uri)
            else:
                self._fail_round(
                    step, PromotionError(f"promoting step {step} to {self.target.uri!r} failed: {start[1]}")
                )
            return
        _, token, prefix = start
        fs = StoreFileSystem(self.target, self.target.generation_path(step))
        fs.token = token
        try:
            report: Any = self._upload(step, manifest, fs, prefix, claim)
        except Exception as exc:  # noqa: BLE001 - gathered, then every rank removes its uploads
            report = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        reports = gather(self.group, report)
        outcome: Any = None
        if self.rank == 0:
            assert claim is not None
            errors = [r for r in reports if isinstance(r, str)]
            try:
                if errors:
                    raise PromotionError("; ".join(errors))
                self._commit(step, manifest, claim, reports)
                outcome = ("ok",)
            except Exception as exc:  # noqa: BLE001 - broadcast below
                claim.abort()
                outcome = ("failed", f"{type(exc).__name__}: {exc}", isinstance(exc, GenerationExistsError))
        outcome = from_first(self.group, outcome)
        if outcome[0] != "ok":
            fs.undo(frozenset())
            if len(outcome) > 2 and outcome[2]:
                _log.info("step %d was committed on %s by another attempt first", step, self.target.uri)
                return
            self._fail_round(
                step,
                PromotionError(
                    f"promoting step {step} to {self.target.uri!r} failed; nothing was committed there: {outcome[1]}"
                ),
            )
            return
        with self._cond:
            self.promoted_step = max(step, self.promoted_step or step)
        _log.info("step %d promoted from %s to %s", step, self.source.uri, self.target.uri)
        self._event("promoted", step=step, promote_s=time.monotonic() - started, target=self.target.uri)
        if self.rank == 0 and self.on_commit is not None:  # the commit hooks (tier="durable")
            self.on_commit(self.target.manifest(step))
        if self.rank == 0:
            retain_quietly(self.target, self.keep_last)
        self._retain_source()

    def _upload(
        self, step: int, manifest: Manifest, fs: StoreFileSystem, prefix: str, claim: Any
    ) -> tuple[list[ObjectEntry], dict[str, str]]:
        """Stream this rank's local objects into the durable generation; (entries, local key -> durable path)."""
        folder = fs.generation + (f"/{prefix.rstrip('/')}" if prefix else "")
        lease = None
        if claim is not None:
            fs.lease = claim.lease
        else:
            token = fs.token or ""
            lease = Lease(self.target, f"{folder}/{attempt_claim_name(token, self.rank)}", step, token, self.rank)
            lease.create()
            fs.lease = lease
        paths: dict[str, str] = {}
        try:
            for obj in manifest.objects:
                if obj.name in (METADATA_NAME, GLOBAL_METADATA_NAME):
                    continue
                if not _DATA_RE.match(obj.name):
                    # An extra object (Lightning's meta.pt, which every rank keeps locally to load from its own
                    # folder): rank 0's copy, under its fixed name, written by the step claim's holder.
                    if claim is not None:
                        with claim.open(obj.name) as stream:
                            read_verified(
                                self.source.fs, object_path(self.source.location, step, obj), obj, into=stream
                            )
                    continue
                target = f"{folder}/{obj.name}"
                with fs.create_stream(target, "wb") as stream:
                    read_verified(self.source.fs, object_path(self.source.location, step, obj), obj, into=stream)
                written = fs.objects[obj.name]
                if written.size != obj.size:
                    raise PromotionError(f"{obj.name}: wrote {written.size} bytes, the local manifest says {obj.size}")
                relative = fs.physical(target)
                paths[obj.key] = relative[len(folder) + 1 :] if relative.startswith(folder + "/") else relative
            with fs._lock:
                entries = list(fs.objects.values())
        except BaseException:
            fs.undo(frozenset())
            raise
        finally:
            if lease is not None:
                lease.release()
        return entries, paths

    def _commit(self, step: int, manifest: Manifest, claim: Any, reports: list[Any]) -> None:
        """Rank 0: record every rank's uploads, write the durable ``.metadata`` (paths rewritten), manifest last."""
        ranks: dict[str, list[str]] = {}
        paths: dict[str, str] = {}
        for rank, (entries, moved) in enumerate(reports):
            for entry in entries:
                claim.record(entry)
            ranks[str(rank)] = [e.name for e in entries]
            paths.update(moved)
        entry = next(o for o in manifest.objects if o.name == GLOBAL_METADATA_NAME)
        data = read_verified(self.source.fs, object_path(self.source.location, step, entry), entry)
        metadata = load_metadata(io.BytesIO(data), where=GLOBAL_METADATA_NAME)
        storage = {}
        for index, info in metadata.storage_data.items():
            if info.relative_path not in paths:
                raise PromotionError(f"step {step}: {info.relative_path!r} of the global metadata was not uploaded")
            storage[index] = replace(info, relative_path=paths[info.relative_path])
        claim.write_bytes(METADATA_NAME, pickle.dumps(replace(metadata, storage_data=storage)))
        claim.commit(
            cut={**manifest.cut, "step": step, "world_size": self.world_size},
            plan=manifest.plan,
            extra={
                "format": DCP_FORMAT,
                "ranks": ranks,
                "dcp_folder": claim.prefix.rstrip("/"),
                PROMOTED_FROM_KEY: {"uri": self.source.uri, "step": step, "run_id": manifest.run_id},
            },
        )

    def _fail_round(self, step: int | None, error: PromotionError) -> None:
        self._fail(step, error, str(error), str(error))
