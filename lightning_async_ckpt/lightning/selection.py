"""``ModelCheckpoint``'s selection on top of the committed-generation store: names, best-k, loggers.

Per cut (every rank) :meth:`Selection.prepare` renders the filename and reads the score; rank 0's top-k decision is
broadcast. Per commit (rank 0) :meth:`Selection.poll` applies best-k retention, sets ``ModelCheckpoint``'s
attributes and calls every logger's ``after_save_checkpoint``.
"""

from __future__ import annotations

import logging
import re
import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_async_ckpt.lightning.arguments import ModelCheckpointConfigError
from lightning_async_ckpt.lightning.arguments import Selection as Args
from lightning_async_ckpt.lightning.naming import comparable_path
from lightning_async_ckpt.lightning.topk import Entry, TopK, kth_best, model_checkpoint_score
from lightning_async_ckpt.storage.retention import remove_best_k

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.store import CheckpointStore


class MonitorMissingError(ModelCheckpointConfigError):
    """The monitored metric was never logged: what ``ModelCheckpoint`` raises as a ``MisconfigurationException``
    (code catching that keeps working), and a :class:`~lightning_async_ckpt.errors.ConfigError`."""


__all__ = [
    "EXTRA_KEY",
    "MonitorMissingError",
    "Selection",
    "after_model_checkpoints",
    "load_selection_state",
    "model_checkpoint_best_k",
    "rebuild_best_k",
    "selection_state",
]

_log = logging.getLogger("lightning_async_ckpt")
#: ``Manifest.extra`` key of what the callback records about a generation.
EXTRA_KEY = "model_checkpoint"
_ATTRS = ("best_model_path", "best_model_score", "best_k_models", "kth_best_model_path", "kth_value")
_ATTRS += ("current_score", "last_model_path")


class Selection:
    """The selection state of one callback (see the module docstring)."""

    def __init__(self, cb: ModelCheckpoint, args: Args, *, weights_only: bool) -> None:
        self.cb = cb
        self.args = args
        self.weights_only = weights_only
        self.topk = TopK(args.top_k, args.mode)
        self._pending: deque[tuple[Entry, Any]] = deque()
        self.cutting: Entry | None = None  # the cut being dumped: the state written into it is its prospective view

    # -- at the cut ------------------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        # By value, without the callback (it holds this selection): a pickled copy of the callback equals it.
        if not isinstance(other, Selection):
            return False
        mine = (self.args, self.weights_only, self.topk, list(self._pending), self.cutting)
        return mine == (other.args, other.weights_only, other.topk, list(other._pending), other.cutting)

    __hash__ = None  # type: ignore[assignment]

    def prepare(
        self, trainer: pl.Trainer, candidates: dict[str, Any], *, ranked: bool, last: bool
    ) -> tuple[bool, Entry]:
        """The entry of a cut at this step, and whether to take it (rank 0's answer on every rank).

        ``ranked``: a ``ModelCheckpoint`` save (interval, epoch, validation); ``False`` for the final checkpoint, a
        retake or a coalesced request, which are kept as the newest generation but never ranked. ``last``: whether
        ``ModelCheckpoint`` writes ``last.ckpt`` here even when the score enters no top k (at batch-end interval
        saves; at epoch ends only beside a top-k save).
        """
        monitor = self.args.monitor
        score = None
        if monitor is not None and ranked:
            value = candidates.get(monitor)
            if value is None:
                logged = [k for k in candidates if not k.startswith("ckpt/")]  # not the callback's own progress
                message = (
                    f"AsyncCheckpointCallback(monitor={monitor!r}) could not find the monitored key in the returned "
                    f"metrics: {logged}. HINT: Did you call `log({monitor!r}, value)` in the LightningModule?"
                )
                if trainer.fit_loop.epoch_loop.val_loop._has_run:
                    raise MonitorMissingError(message)
                rank_zero_warn(message)
            else:
                score = float(value.item() if isinstance(value, torch.Tensor) else value)
                score = model_checkpoint_score(score, self.args.mode)
        epoch, step = int(candidates["epoch"]), int(candidates["step"])
        entry = Entry(step=trainer.global_step, score=score, filename=self._name(dict(candidates)), epoch=epoch)
        if monitor is None or not ranked:
            # save_top_k=0 without a monitor: only save_last cuts (none at all without it), like ModelCheckpoint.
            return self.args.save_top_k != 0 or bool(self.args.save_last) or not ranked, entry
        enters = self.topk.enters(score) if trainer.is_global_zero else False
        if trainer.world_size > 1:
            enters = bool(trainer.strategy.broadcast(enters, src=0))
        if enters and not self.cb._enable_version_counter:
            replaced = self.topk.same_name(entry.filename)
            entry.supersedes = replaced.step if replaced is not None else None
        if not enters:
            entry.score = None
            if self.cb.verbose and score is not None:
                rank_zero_info(f"Epoch {epoch:d}, global step {step:d}: {monitor!r} was not in top {self.args.top_k}")
        return enters or (bool(self.args.save_last) and last), entry

    def _name(self, metrics: dict[str, Any]) -> str:
        cb = self.cb
        name = cb._format_checkpoint_name(cb.filename, metrics, auto_insert_metric_name=cb.auto_insert_metric_name)
        candidate, version = name, cb.STARTING_VERSION
        # Like ModelCheckpoint: a name in use gets -v1, -v2, ... except the name of the one this save replaces.
        replaced = self.topk.replaced(monitored=self.args.monitor is not None)
        while cb._enable_version_counter and self.topk.name_in_use(candidate + cb.FILE_EXTENSION, but=replaced):
            candidate = cb.CHECKPOINT_JOIN_CHAR.join((name, f"v{version}"))
            version += 1
        return candidate + cb.FILE_EXTENSION

    def extra(self, entry: Entry) -> dict[str, Any]:
        """What the manifest records about the cut."""
        body = {"filename": entry.filename, "epoch": entry.epoch, "weights_only": self.weights_only}
        body.update(monitor=self.args.monitor, mode=self.args.mode, score=entry.score, ranked=entry.score is not None)
        return {EXTRA_KEY: body}

    def admitted(self, entry: Entry, handle: Any) -> None:
        """The cut was admitted; ``handle`` is rank 0's save handle (``None`` elsewhere)."""
        self.topk.requested(entry)
        if handle is not None:
            self._pending.append((entry, handle))

    # -- after commits (rank 0, training thread) -----------------------------------------------------------
    def poll(self, trainer: pl.Trainer, store: CheckpointStore | None, path_of: Any) -> None:
        """Take in the saves that ended, oldest first; ``path_of(manifest)`` is the loadable checkpoint path."""
        while self._pending and self._pending[0][1].committed.done():
            entry, handle = self._pending.popleft()
            future = handle.committed
            if future.cancelled() or future.exception() is not None:
                self.topk.failed(entry.step)
                continue
            self.topk.committed(entry.step, path_of(future.result()))
            self._retain(store)
            self.publish()
            if self.cb.verbose and entry.score is not None:
                rank_zero_info(
                    f"Epoch {entry.epoch:d}, global step {entry.step:d}: {self.args.monitor!r} reached "
                    f"{entry.score:0.5f} (best {float(self.cb.best_model_score):0.5f}), committed {entry.path!r} "
                    f"as top {self.args.top_k}"
                )
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(weakref.proxy(self.cb))

    def _retain(self, store: CheckpointStore | None) -> None:
        if self.args.monitor is None:
            # Count-based retention is the engine's (keep_last); only the newest committed one is needed here.
            newest = self.topk.newest(1)
            for entry in list(self.topk.entries.values()):
                if entry.committed and entry is not newest[0]:
                    self.topk.removed(entry.step)
            return
        steps = self.topk.to_remove(self.args.keep_newest)
        if store is None or not steps:
            return
        foreign = [s for s in steps if self.topk.entries[s].foreign]
        for step in foreign:  # another branch's generation: out of this run's top k, left on storage
            self.topk.removed(step)
        steps = [s for s in steps if s not in foreign]
        if not steps:
            return
        keep = {e.step for e in self.topk.best()} | {e.step for e in self.topk.newest(self.args.keep_newest)}
        for step in remove_best_k(store, steps, keep):
            self.topk.removed(step)

    def publish(self) -> None:
        """Set ``ModelCheckpoint``'s attributes on the callback from the committed view."""
        newest = self.topk.newest(1)
        ranked = [e for e in self.topk.entries.values() if e.committed and e.score is not None]
        current = max(ranked, key=lambda e: (not e.foreign, e.step)) if ranked else None  # this location's first
        for name, value in self._view(self.topk.best(), newest[0] if newest else None, current).items():
            setattr(self.cb, name, value)

    def prospective(self, entry: Entry) -> dict[str, Any]:
        """``ModelCheckpoint``'s attributes as they are once ``entry`` (and every save requested before it) commits:
        what ``ModelCheckpoint`` writes into a file's own state (it is its own best when it enters the top k)."""
        ranked = [e for e in self.topk.entries.values() if e.score is not None and e.step != entry.step]
        current = entry if entry.score is not None else max(ranked, key=lambda e: (not e.foreign, e.step), default=None)
        view = self._view(self.topk.prospective(entry), entry, current)
        return {name: view.get(name, getattr(self.cb, name)) for name in _ATTRS}

    def _view(self, best: list[Entry], newest: Entry | None, current: Entry | None) -> dict[str, Any]:
        """``ModelCheckpoint``'s attributes for a top k ``best`` (best first), the newest generation and the newest
        ranked one; the k-th best only once the top k is full, like ``ModelCheckpoint``."""
        view: dict[str, Any] = {"last_model_path": newest.location if newest and self.args.save_last else ""}
        if self.args.monitor is None:
            # save_top_k=0 keeps no "best" (only last), like ModelCheckpoint: ckpt_path="best" fails there too.
            view["best_model_path"] = newest.location if newest and self.args.save_top_k != 0 else ""
            return view
        view["best_k_models"] = {e.location: _tensor(e.score) for e in best}
        view["best_model_path"] = best[0].location if best else ""
        view["best_model_score"] = _tensor(best[0].score) if best else None
        if best and (self.args.top_k < 0 or len(best) == self.args.top_k):
            kth = kth_best(best)
            view["kth_best_model_path"], view["kth_value"] = kth.location, _tensor(kth.score)
        if current is not None:
            view["current_score"] = _tensor(current.score)
        return view

    # -- across ranks and restarts ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The published attributes (rank 0's are broadcast to the other ranks at the end of fit)."""
        return {name: getattr(self.cb, name) for name in _ATTRS}

    def apply(self, summary: dict[str, Any]) -> None:
        """Set the attributes from rank 0's :meth:`summary`."""
        for name, value in summary.items():
            setattr(self.cb, name, value)

    def adopt(self, best_k: dict[str, Any], exists: Any) -> None:
        """Rank the files of a ``ModelCheckpoint``'s restored ``best_k_models`` (see :func:`model_checkpoint_best_k`)
        like this run's generations: "best" never points at a worse model than that callback's best. They stay on
        storage (never removed by this callback's retention) and only those ``exists(path)`` confirms count."""
        if self.args.monitor is None:
            return
        for i, (path, score) in enumerate(sorted(best_k.items())):
            if score is None or not exists(path):
                continue
            match = re.search(r"step=(\d+)", str(path).rsplit("/", 1)[-1])
            step = int(match.group(1)) if match else -(i + 1)
            if step in self.topk.entries:
                step = -(i + 1)
            value = model_checkpoint_score(
                float(score.item() if isinstance(score, torch.Tensor) else score), self.args.mode
            )
            self.topk.requested(Entry(step, value, str(path).rsplit("/", 1)[-1], 0, foreign=True))
            self.topk.committed(step, str(path))
        self.publish()

    def restore(
        self,
        store: CheckpointStore,
        run_id: str | None,
        up_to: int,
        path_of: Any,
        *,
        foreign: bool = False,
        remembered: dict[str, Any] | None = None,
    ) -> None:
        """Rebuild the committed view from the manifests of ``run_id`` up to step ``up_to`` (a resumed run).

        ``foreign``: ``store`` is not where this fit writes (a branch into a new version): its generations rank like
        ``ModelCheckpoint``'s restored ``best_k_models`` but retention never removes them. ``remembered``: the restored
        ``best_k_models``; those outside ``store`` rank the same way.
        """
        self.topk.entries.clear()
        self._pending.clear()
        for info in store.generations():
            if info.manifest is None or info.run_id != run_id or info.step > up_to:
                continue
            body = info.manifest.extra.get(EXTRA_KEY) or {}
            ranked = body.get("ranked") and body.get("monitor") == self.args.monitor and self.args.monitor
            score = body.get("score") if ranked else None
            score = None if score is None else model_checkpoint_score(float(score), self.args.mode)
            entry = Entry(info.step, score, str(body.get("filename", "")), int(body.get("epoch", 0)), foreign=foreign)
            self.topk.requested(entry)
            self.topk.committed(info.step, path_of(info.manifest))
        self._retain(None)
        own = comparable_path(store.uri) + "/step-"
        outside = {p: v for p, v in (remembered or {}).items() if not comparable_path(str(p)).startswith(own)}
        self.adopt(outside, store.fs.exists)
        self.publish()


def rebuild_best_k(cb: Any, start_step: int) -> None:
    """A resumed fit's best-k, on the writing rank: from the manifests of the run resumed (a generation counts once
    committed), where they are; a fit that branched into a new version ranks them too, but never removes them.

    Args:
        cb: The ``AsyncCheckpointCallback`` (its ``resumed_location`` was set by ``rerun.place_run``).
        start_step: The step training starts from.
    """
    resumed = getattr(cb, "resumed_location", None)
    if resumed is None and cb._model_checkpoint_best:
        # Resumed from a ModelCheckpoint's file (its last.ckpt): rank the best k it had saved.
        cb.selection.adopt(cb._model_checkpoint_best, cb.store.fs.exists)
    elif resumed is not None and resumed.store.uri != cb.store.uri:
        path_of = lambda m: cb._path_of(m, resumed.store)  # noqa: E731
        cb.selection.restore(resumed.store, resumed.run_id, resumed.step, path_of, foreign=True)
    else:
        remembered = dict(cb.best_k_models or {})  # from the checkpoint's state, when Lightning restored it
        cb.selection.restore(cb.store, cb.run_id, start_step, cb._path_of, remembered=remembered)


def model_checkpoint_best_k(checkpoint: dict[str, Any], monitor: str | None, dirpath: str | None) -> dict[str, Any]:
    """``best_k_models`` of a plain ``ModelCheckpoint`` (same ``monitor`` and ``dirpath``) saved in ``checkpoint``.

    A script that replaced its ``ModelCheckpoint`` by this callback and resumed from the ``last.ckpt`` it left: that
    checkpoint carries the old callback's best k under the old callback's state key, which Lightning never hands to
    this one.
    """
    if monitor is None or dirpath is None:
        return {}
    found: dict[str, Any] = {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(key, str) and key.startswith("ModelCheckpoint{") and isinstance(state, dict)):
            continue
        if state.get("monitor") == monitor and comparable_path(str(state.get("dirpath"))) == comparable_path(
            str(dirpath)
        ):
            found.update(state.get("best_k_models") or {})
    return found


def after_model_checkpoints(cb: ModelCheckpoint, callbacks: list[Any]) -> list[Any]:
    """``callbacks`` with ``cb`` moved right after the last plain ``ModelCheckpoint`` listed after it, if any.

    Lightning's ``trainer.checkpoint_callback`` (what ``ckpt_path="best"`` reads) is the first checkpoint callback:
    a ``ModelCheckpoint`` the user listed beside this callback keeps that role. Nothing else moves.
    """
    others = [i for i, c in enumerate(callbacks) if isinstance(c, ModelCheckpoint) and not isinstance(c, type(cb))]
    mine = next((i for i, c in enumerate(callbacks) if c is cb), None)
    if mine is None or not others or others[-1] < mine:  # set up outside trainer.callbacks: nothing to move
        return callbacks
    rest = [c for c in callbacks if c is not cb]
    return [*rest[: others[-1]], cb, *rest[others[-1] :]]


def selection_state(cb: ModelCheckpoint) -> dict[str, Any]:
    """``ModelCheckpoint.state_dict``'s entries, for the callback's state in each checkpoint."""
    names = ("monitor", "best_model_score", "best_model_path", "current_score", "dirpath", "best_k_models")
    names += ("kth_best_model_path", "kth_value", "last_model_path")
    state = {name: getattr(cb, name) for name in names}
    selection = getattr(cb, "selection", None)
    if isinstance(selection, Selection) and selection.cutting is not None:
        # Written into the checkpoint being cut: as ModelCheckpoint writes it, once that checkpoint is saved.
        state.update(selection.prospective(selection.cutting))
    return state


def load_selection_state(cb: ModelCheckpoint, state: dict[str, Any]) -> None:
    """``ModelCheckpoint.load_state_dict``: the attributes, when the checkpoint was written to the same ``dirpath``.

    A callback that already follows commits keeps its own view (Lightning restores callbacks at
    ``validate(ckpt_path="best")`` too, and a checkpoint's copy is the view of when it was saved); a resumed fit
    rebuilds the view from the committed manifests (:meth:`Selection.restore`).
    """
    selection = getattr(cb, "selection", None)
    if isinstance(selection, Selection) and selection.topk.entries:
        return
    if "best_model_path" not in state:
        return
    dirpath = state.get("dirpath", cb.dirpath)
    if dirpath == cb.dirpath:
        for name in ("best_model_score", "current_score", "best_k_models"):
            setattr(cb, name, state.get(name, getattr(cb, name)))
        for name in ("kth_best_model_path", "kth_value", "last_model_path"):
            setattr(cb, name, state.get(name, getattr(cb, name)))
    else:  # ModelCheckpoint.load_state_dict's rule and warning
        warnings.warn(
            f"The dirpath has changed from {dirpath!r} to {cb.dirpath!r}, therefore `best_model_score`, "
            "`kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` won't be reloaded. Only "
            "`best_model_path` will be reloaded.",
            stacklevel=2,
        )
    cb.best_model_path = state["best_model_path"]


def _tensor(score: float | None) -> torch.Tensor | None:
    return None if score is None else torch.tensor(score, dtype=torch.float32)
