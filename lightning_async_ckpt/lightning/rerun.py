"""Where a fit writes: the run it continues, or a new version beside the runs already in ``dirpath``.

Two runs' generations never mix. :func:`place_run` (when training starts, after Lightning restored the checkpoint)
continues a run in the location it resumed from when the callback's run id wrote there and nothing there is newer
than the resumed step (a resume of the newest checkpoint adopts its run id, :func:`resumed_generation`); otherwise,
when ``dirpath`` already holds committed generations, it writes to a new version ``<dirpath>/v1``, ``v2``, ...
Nothing of the earlier run is touched. ``ckpt_path="last"`` picks the newest step of the highest version holding an
intact generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.errors import GenerationExistsError
from lightning_async_ckpt.lightning.naming import Location, comparable_path, run_locations, version_uri
from lightning_async_ckpt.lightning.resume import resumed_from
from lightning_async_ckpt.storage.generation import VERSION_RE
from lightning_async_ckpt.storage.store import CheckpointStore

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "VERSION_RE",
    "Placement",
    "Resumed",
    "place_run",
    "resumed_generation",
]


def choose_version(
    locations: list[Location], run_id: str | None, start_step: int, *, prefer: int | None = None
) -> tuple[int, str]:
    """The version a fit of run ``run_id`` starting at ``start_step`` writes to, and why (for the message).

    ``prefer``: the only location the fit may continue (the one it resumed from, or the one its callback writes to):
    a branch shares its run id with the history it branched from, so "holds that run" alone does not say where the
    fit continues.
    """
    taken = []
    for loc in locations:
        found = _occupied(loc.store)
        gens = [g for g in found if g.committed]
        if not gens:
            continue
        taken.append(loc.version)
        if prefer is not None and loc.version != prefer:
            continue
        newest = max(g.step for g in found)
        if run_id is not None and any(g.run_id == run_id for g in gens) and newest <= start_step:
            return loc.version, "continues its run"
    if not taken or 0 not in taken:
        return 0, "empty"
    described = ", ".join(f"v{v}" if v else "dirpath" for v in taken)
    return max(loc.version for loc in locations) + 1, f"holds committed checkpoints ({described})"


@dataclass
class Placement:
    """Where a fit writes, as :func:`place_run` decided it; the callback applies it to itself.

    Attributes:
        run_id: The run id of this fit on every rank (a resumed run's, when the fit continues it).
        resumed: The committed generation the fit restored (where best-k is rebuilt from), or ``None``.
        store: A new location to write to (a version folder), or ``None`` to keep the callback's store.
        checkpointer: The engine opened on ``store`` (fences declared), or ``None``.
        committed: Steps already committed at ``store`` (a step the fit would write again is refused).
    """

    run_id: str | None
    resumed: Resumed | None = None
    store: CheckpointStore | None = None
    checkpointer: Any = None
    committed: set[int] = field(default_factory=set)


def place_run(callback: Any, trainer: pl.Trainer) -> Placement:
    """Before the first training step: decide the place this fit writes to (reads the callback, assigns nothing).

    Collective in multi-process runs (every rank calls it; the writing rank decides). Called from
    ``AsyncCheckpointCallback.on_train_start``; a move closes the callback's checkpointer (nothing was saved yet).

    Returns:
        The placement, the same ``run_id`` on every rank.
    """
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_async_ckpt.core.capture import Fence
    from lightning_async_ckpt.core.engine import AsyncCheckpointer
    from lightning_async_ckpt.lightning.collective import agree_on

    error: BaseException | None = None
    store, placement = callback.store, Placement(run_id=callback.run_id)
    # The writing rank of a single-writer fit (sharded strategies have a writer per rank and are not placed here).
    if store is not None and callback.checkpointer is not None and not callback.checkpointer.writes_dcp:
        try:
            dirpath = callback.dirpath
            locations = run_locations(dirpath, callback.storage_options)
            resumed = resumed_generation(locations, resumed_from(callback, trainer))
            placement.resumed = resumed  # where best-k is rebuilt from (callback.on_train_start)
            if resumed is not None and resumed.newest and resumed.run_id and resumed.run_id != callback.run_id:
                # Resumed from the newest checkpoint of a location, without the callback state that carries the
                # run id (Lightning restores it only for the same callback state key: same dirpath and
                # intervals): it is still that run continuing.
                placement.run_id = store.run_id = resumed.run_id
            # Continue where the resumed checkpoint is, else where this callback writes (a second fit).
            where = resumed.store if resumed is not None else None
            prefer = next((loc.version for loc in locations if loc.store is where), None)
            if prefer is None:
                own = comparable_path(store.uri)
                prefer = next((loc.version for loc in locations if comparable_path(loc.store.uri) == own), None)
            version, why = choose_version(locations, placement.run_id, trainer.global_step, prefer=prefer)
            target = version_uri(dirpath, version)
            if target != store.uri and version > 0 and not getattr(callback, "_enable_version_counter", True):
                raise GenerationExistsError(
                    f"dirpath {dirpath!r} {why} of another run (or of later steps than this fit starts from, step "
                    f"{trainer.global_step}), and enable_version_counter=False forbids writing beside them "
                    "(committed checkpoints are never overwritten): resume that run with "
                    "trainer.fit(..., ckpt_path='last'), pass enable_version_counter=True to write this run to "
                    f"{target!r}, or use a new dirpath"
                )
            if target != store.uri:
                if version > 0 and why != "continues its run":
                    rank_zero_warn(
                        f"dirpath {dirpath!r} {why} of another run (or of later steps than this fit starts from, "
                        f"step {trainer.global_step}); this run writes to {target!r} and leaves them untouched. "
                        "To continue the earlier run instead, pass trainer.fit(..., ckpt_path='last')"
                    )
                callback.checkpointer.close()
                callback.selection.topk.moved()  # a previous fit's generations stay where they are
                placement.store = CheckpointStore(target, callback.storage_options, run_id=placement.run_id)
                placement.checkpointer = AsyncCheckpointer(placement.store, callback.options)
                placement.checkpointer.declare_fences({Fence.BATCH_START, Fence.OPTIMIZER_STEP})
                placement.committed = {g.step for g in placement.store.generations()}
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            error = exc
    agree_on(trainer, error, "choosing where this run's checkpoints go")
    if trainer.world_size > 1:  # the writing rank may have adopted one
        placement.run_id = trainer.strategy.broadcast(placement.run_id, src=0)
    return placement


@dataclass(frozen=True)
class Resumed:
    """The committed generation a fit restored, found in ``dirpath`` or one of its versions.

    Attributes:
        store: The location (``dirpath`` or a version) holding it, read-only.
        step: Its step.
        run_id: The run that wrote it (from its manifest).
        newest: Whether no step of that location that is never written again is newer (the run continues there).
    """

    store: CheckpointStore
    step: int
    run_id: str
    newest: bool


def resumed_generation(locations: list[Location], resumed: str | None) -> Resumed | None:
    """The committed generation ``resumed`` points into, or ``None`` (a fresh fit, or a checkpoint elsewhere).

    Args:
        locations: ``dirpath`` and its versions (:func:`run_locations`).
        resumed: The checkpoint the fit restored (a URL, or a local path), or ``None`` for a fresh fit.
    """
    if not resumed:
        return None
    target = comparable_path(resumed)
    for loc in locations:
        found = _occupied(loc.store)
        for gen in found:
            base = comparable_path(loc.store.url(gen.step))
            if gen.committed and (target == base or target.startswith(base + "/")):
                newest = max(g.step for g in found) <= gen.step
                return Resumed(store=loc.store, step=gen.step, run_id=gen.run_id or "", newest=newest)
    return None


def seed_committed_step(callback: Any, ckpt_path: str | None) -> int | None:
    """When a fit restores a committed generation of ``dirpath`` (or of a version), its step is the newest
    recoverable progress until this fit commits another: the caller's ``committed_step`` says so (also when the fit
    has nothing left to train). Called while Lightning restores the checkpoint; the writing rank only.

    Returns:
        The restored generation's step, or ``None`` when there is nothing to seed.
    """
    checkpointer = callback.checkpointer
    if callback.store is None or checkpointer is None or checkpointer.committed_step is not None or not ckpt_path:
        return None
    found = resumed_generation(run_locations(callback.dirpath, callback.storage_options), str(ckpt_path))
    return None if found is None else found.step


def _occupied(store: CheckpointStore) -> list[Any]:
    """The generations whose step is never written again (``GenerationInfo.holds_step``: committed, a newer format
    version, or a manifest unreadable right now).

    A run may only continue where none is newer than its start. A leftover without a manifest, or with a torn one (a
    crash while a filesystem without atomic puts wrote it), was never recoverable and does not count: the writer of
    that step replaces it (``CheckpointStore.begin_write``), so the run continues in place.
    """
    return [g for g in store.scan(include_uncommitted=True).generations if g.holds_step]
