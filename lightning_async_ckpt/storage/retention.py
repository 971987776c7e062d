"""Retention: a pure plan of which generations to remove (with reasons), and the executor that reports it.

The plan (:func:`plan_retention`) reads nothing and deletes nothing: it gets what the store found (each
generation, whether its objects are complete, who claims an uncommitted one) and decides. Its rules:

- only **verified complete** generations count toward ``keep_last`` (every object present at its manifest
  size; checksums too when asked, or where cheap with ``verify=None``); a damaged generation is never counted
  and is reported as refused;
- a committed generation is removed only when it belongs to this run (or ``all_runs``) and is older than the
  oldest kept complete one, so retention never leaves fewer recoverable generations than ``keep_last`` (or
  than there were, when there were fewer);
- an uncommitted leftover is removed only when it is older than the newest complete commit, is not being
  written by this store, and it has writer claims, all of this run's (a crashed attempt of this run), or is what
  this store's own removal left when it stopped after the manifest; with ``all_runs`` (the operator acting for
  the whole folder) any leftover at least ``min_leftover_age_s`` old. Another run's leftover may be a save in
  progress: it is refused, with the reason. A claim whose lease has not expired (:mod:`.claims`) is a live
  writer, whatever its run id: its leftover is refused even for this run. A folder with neither a manifest nor a
  claim holds files the library never wrote (every writer claims a step before writing data), unless this store
  wrote or removed that step (a failed attempt releases its claims): it is left alone and reported once at WARNING;
- removing a committed generation removes its manifest's objects, claims and manifest, never other files there;
- only what the pass looked at is decided on: the folder is walked newest first down to the end of this run's
  lineage (:mod:`.ledger`); what lies below is neither read nor removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_async_ckpt.storage.claims import leftover_writers, written_beside
from lightning_async_ckpt.storage.generation import generation_name
from lightning_async_ckpt.storage.listing_check import check_listed
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME, SPREAD_FOLDER, Manifest

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.generation import GenerationInfo
    from lightning_async_ckpt.storage.view import StoreView

__all__ = [
    "FOREIGN",
    "Candidate",
    "Refusal",
    "Removal",
    "RetentionPlan",
    "RetentionReport",
    "execute",
    "plan_best_k",
    "plan_retention",
    "remove_best_k",
]

_log = logging.getLogger(__name__)
#: The refusal of an uncommitted folder without a claim or a manifest (reported once per store at WARNING).
FOREIGN = "no manifest or writer claim of this library: files it did not write are left alone"
# Generations at most this large are checksum-verified before they count (cheap); larger ones by size.
CHEAP_VERIFY_BYTES = 64 << 20


@dataclass(frozen=True)
class Candidate:
    """What the store found about one generation, for the plan.

    Attributes:
        info: The listing entry.
        problems: For a committed generation: why it is not complete (empty: complete; ``None``: not checked).
        writers: For an uncommitted one: the run ids of the writer claims found in it (``"?"`` unreadable).
        age_s: Seconds since its newest claim (or folder time) was written, when known.
    """

    info: GenerationInfo
    problems: tuple[str, ...] | None = None
    writers: tuple[str, ...] = ()
    age_s: float | None = None


@dataclass(frozen=True)
class Removal:
    """One generation the plan removes, and why."""

    step: int
    committed: bool
    reason: str


@dataclass(frozen=True)
class Refusal:
    """One generation the plan refused to count or to remove, and why."""

    step: int
    reason: str


@dataclass(frozen=True)
class RetentionPlan:
    """The decision: steps kept as the newest complete ones, removals and refusals."""

    keep: tuple[int, ...]
    remove: tuple[Removal, ...]
    refused: tuple[Refusal, ...]


@dataclass
class RetentionReport:
    """What ``gc`` did: ``removed`` steps, ``failed`` removals (step, error), ``refused`` (step, reason)."""

    plan: RetentionPlan
    removed: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    dry_run: bool = False

    @property
    def refused(self) -> tuple[Refusal, ...]:
        """Generations not counted or not removed, with the reason."""
        return self.plan.refused


def plan_retention(
    candidates: list[Candidate],
    *,
    keep_last: int,
    run_id: str,
    all_runs: bool,
    writing: frozenset[int] = frozenset(),
    min_leftover_age_s: float = 0.0,
    ours: frozenset[int] = frozenset(),
) -> RetentionPlan:
    """Decide which generations to remove (pure: no I/O). See the module docstring for the rules.

    ``ours``: steps this store wrote or began removing (their leftovers are the library's, claims or not).
    """
    gens = sorted(candidates, key=lambda c: c.info.step)
    refused: list[Refusal] = []

    def owned(c: Candidate) -> bool:
        return all_runs or c.info.run_id == run_id

    committed = [c for c in gens if c.info.committed]
    keep: list[int] = []
    for c in reversed(committed):
        if not owned(c) or c.problems is None:
            continue
        if c.problems:
            refused.append(Refusal(c.info.step, "not counted as recoverable: " + "; ".join(c.problems)))
        elif len(keep) < keep_last:
            keep.append(c.info.step)
    complete = [c.info.step for c in committed if c.problems == ()]
    newest = max(complete) if complete else None
    oldest_kept = min(keep) if keep else None
    remove: list[Removal] = []
    for c in gens:
        step = c.info.step
        if step in keep or step in writing:
            continue
        if c.info.committed:
            if owned(c) and oldest_kept is not None and step < oldest_kept:
                why = "damaged and older" if c.problems else "older"
                remove.append(Removal(step, True, f"{why} than the newest {len(keep)} verified generation(s)"))
            continue
        reason = _leftover_refusal(c, newest, run_id, all_runs, min_leftover_age_s, step in ours)
        if reason is None:
            remove.append(Removal(step, False, "uncommitted leftover older than the newest commit"))
        else:
            refused.append(Refusal(step, reason))
    if not keep and committed:
        refused.append(Refusal(committed[-1].info.step, "no verified complete generation to keep: removing nothing"))
    return RetentionPlan(keep=tuple(sorted(keep)), remove=tuple(remove), refused=tuple(refused))


def _leftover_refusal(
    c: Candidate, newest: int | None, run_id: str, all_runs: bool, min_age_s: float, ours: bool
) -> str | None:
    info = c.info
    if info.newer_format:
        return "manifest of a newer format version (an upgrade can read it)"
    if info.unreadable:
        return f"manifest unreadable right now ({info.error})"
    if newest is None or info.step >= newest:
        return "uncommitted and newer than the newest verified commit: may be in progress"
    if info.error or (c.writers and all(w == run_id for w in c.writers)):
        # A rejected manifest was never recoverable; a claim of this run is this run's crashed attempt.
        return None
    if all_runs and (c.age_s is None or c.age_s >= min_age_s):
        return None
    if not c.writers:
        # Every writer claims a step before writing data: files without a claim or a manifest are not the
        # library's, unless this store wrote that step (a failed attempt) or its removal stopped half-way.
        return None if ours else FOREIGN
    who = ", ".join(sorted(set(c.writers))) if c.writers else "an unknown writer"
    return f"uncommitted, written by {who}: may be another run's save in progress"


def execute(
    store: StoreView,
    keep_last: int,
    *,
    all_runs: bool = False,
    dry_run: bool = False,
    verify: bool | None = False,
    min_leftover_age_s: float = 0.0,
    protect: frozenset[int] = frozenset(),
    generations: list[GenerationInfo] | None = None,
) -> RetentionReport:
    """Look at ``store``, plan retention and carry it out (removals: manifest first, then data).

    ``verify``: ``True`` checks the checksums of the generations counted as kept, ``None`` only of those up to
    ``CHEAP_VERIFY_BYTES``, ``False`` sizes only. ``protect``: steps never removed, beside the newest ``keep_last``
    (``gc``'s best-k generations). ``generations``: the caller's full listing, just read (``store.generations(
    include_uncommitted=True)``), used instead of listing again (the CLI's ``gc`` reads each manifest once).
    """
    # One listing walked down this run's lineage; manifests read only where the ledger does not know them as
    # committed (module docstring of .ledger), and again for this run's committed ones (kept or removable) unless
    # just read: O(keep_last) per save, and a new store's first pass does not grow with the generations below.
    if generations is not None:
        gens, fresh = sorted(generations, key=lambda g: g.step), {g.step for g in generations}
        store.ledger.learn(gens)
    else:
        gens, fresh = store.ledger.refresh(store.location, None if all_runs else store.run_id)
    candidates = []
    kept = 0
    for i, info in enumerate(reversed(gens)):
        problems: tuple[str, ...] | None = None
        writers: tuple[str, ...] = ()
        age = None
        if info.committed and (all_runs or info.run_id == store.run_id) and info.step not in fresh:
            # Kept or removable: read as it is now, not as remembered (a manifest damaged since is not counted).
            info = gens[len(gens) - 1 - i] = store.ledger.reread(store.location, info.step)
        if info.committed and info.manifest is not None:
            if (all_runs or info.run_id == store.run_id) and kept < keep_last:
                cheap = verify or (verify is None and info.manifest.total_bytes <= CHEAP_VERIFY_BYTES)
                problems = tuple(
                    store.verify(info.step, manifest=info.manifest).problems
                    if cheap
                    else check_listed(store.location, info.manifest)  # one listing, not a HEAD per object
                )
                kept += not problems
        elif not info.unreadable and not info.newer_format:
            writers, age = leftover_writers(store, info.step, info.mtime)
        candidates.append(Candidate(info, problems, writers, age))
    plan = plan_retention(
        candidates,
        keep_last=keep_last,
        run_id=store.run_id,
        all_runs=all_runs,
        writing=store.writing() | protect,
        min_leftover_age_s=min_leftover_age_s,
        ours=store.ledger.ours,
    )
    report = RetentionReport(plan=plan, dry_run=dry_run)
    for refusal in plan.refused:
        if refusal.reason == FOREIGN and store.ledger.first_report(refusal.step):
            _log.warning(
                "%s holds files not written by lightning_async_ckpt (%s); move them out of dirpath",
                store.generation_path(refusal.step),
                refusal.reason,
            )
        else:
            _log.info("retention: not counting/removing step %d: %s", refusal.step, refusal.reason)
    if dry_run:
        report.removed = [r.step for r in plan.remove]
        return report
    by_step = {g.step: g for g in gens}
    for removal in plan.remove:
        try:
            info = by_step[removal.step]
            store.ledger.removed(removal.step)  # forgotten first: a removal that fails half-way is read again
            _remove(store, info)
            report.removed.append(removal.step)
        except Exception as exc:  # noqa: BLE001 - reported in `failed`; a leftover is collected next time
            _log.warning("could not remove generation %s", by_step[removal.step].path, exc_info=True)
            report.failed.append((removal.step, f"{type(exc).__name__}: {exc}"))
    return report


def plan_best_k(
    committed: dict[int, str], keep: set[int], *, run_id: str, writing: frozenset[int] = frozenset()
) -> tuple[int, ...]:
    """Best-k retention (pure): which committed generations to remove, given the steps a ranking keeps.

    ``committed`` maps each candidate step to the run id of its manifest. A step is removed only when it is of
    ``run_id``, not in ``keep``, not being written, and older than the newest kept step (the caller keeps the
    newest committed generation, what ``ckpt_path="last"`` resumes from). Nothing is removed when ``keep`` is
    empty.
    """
    if not keep:
        return ()
    newest_kept = max(keep)
    return tuple(
        step
        for step in sorted(committed)
        if step not in keep and step not in writing and step < newest_kept and committed[step] == run_id
    )


def remove_best_k(store: StoreView, steps: list[int], keep: set[int]) -> list[int]:
    """Remove the committed generations ``steps`` that best-k retention gave up (rules: :func:`plan_best_k`).

    Each generation's manifest is read again first, so only one committed by this store's run is removed.
    Removal goes manifest first, then data. Returns the steps removed or found gone already (no manifest, no
    folder); a removal that fails is logged and left for the next call.
    """
    infos = {step: store.read_generation(step) for step in steps}
    committed = {s: i.run_id or "" for s, i in infos.items() if i.committed}
    removed = [s for s, i in infos.items() if not i.committed and i.error is None and i.mtime is None]
    for step in plan_best_k(committed, keep, run_id=store.run_id, writing=store.writing()):
        try:
            _remove(store, infos[step])
            removed.append(step)
        except Exception:  # noqa: BLE001 - retention never fails training; retried after the next commit
            _log.warning("could not remove generation %s", infos[step].path, exc_info=True)
    return removed


def _remove(store: StoreView, info: GenerationInfo) -> None:
    path = store.generation_path(info.step)
    if info.manifest is None:
        try:
            store.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        if store.hashed_prefixes:
            _sweep_spread(store, info.step)  # a failed attempt's spread data files (no manifest lists them)
    else:
        # Manifest first (a crash leaves an uncommitted leftover, never a manifest without data), then this
        # generation's objects; another writer's prefix ("w-<token>/" not listed here) is left alone.
        store.fs.rm_file(f"{path}/{MANIFEST_NAME}")
        store.backend.sync_folder(path)
        keys = {obj.key for obj in info.manifest.objects if obj.root_path is None}
        own = {obj.key.split("/", 1)[0] for obj in info.manifest.objects if obj.path}  # this attempt's prefix
        files = store.fs.find(path)
        # Left alone: another writer's prefix ("w-<token>/" not listed here) and files the library never writes.
        foreign = [f for f in files if _prefix(f, path) not in own and not written_beside(f, path, keys)]
        _remove_spread(store, info.manifest)
        if not foreign:
            try:
                store.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            store.invalidate_cache()
            return
        for f in files:
            if f not in foreign:
                store.fs.rm_file(f)
        store.backend.remove_folder_if_empty(path)
    store.invalidate_cache()


def _remove_spread(store: StoreView, manifest: Manifest) -> None:
    """Remove the generation's objects spread over hashed prefixes (outside its folder), after its manifest: one
    batched delete (S3: ``DeleteObjects``, 1,000 keys per request), whatever the number of ranks."""
    spread = [f"{store.root}/{obj.root_path}" for obj in manifest.objects if obj.root_path]
    if spread:
        _remove_files(store, spread)


def _remove_files(store: StoreView, paths: list[str]) -> None:
    """Remove ``paths`` (S3: batched, ``DeleteObjects``; elsewhere one at a time), then their emptied folders."""
    if store.backend.kind == "s3":
        store.fs.rm(paths)  # missing keys are no error there
    else:
        for path in paths:
            try:
                store.fs.rm_file(path)
            except FileNotFoundError:
                pass
    for folder in sorted({path.rsplit("/", 1)[0] for path in paths}):
        store.backend.remove_folder_if_empty(folder)  # local disk: the emptied folders (object stores: none)


def _sweep_spread(store: StoreView, step: int) -> None:
    """Remove generation ``step``'s folder under every spread prefix (``spread/<h>/step-N/``): one listing per
    prefix, then one batched delete of what they found (S3: ``DeleteObjects``, 1,000 keys per request)."""
    found: list[str] = []
    folders = [f"{store.root}/{SPREAD_FOLDER}/{digit}/{generation_name(step)}" for digit in "0123456789abcdef"]
    for folder in folders:
        try:
            found += store.fs.find(folder)
        except FileNotFoundError:
            continue
    if found:
        _remove_files(store, found)


def _prefix(file: str, folder: str) -> str:
    """The first folder of ``file`` below ``folder`` ("" for a file directly in it)."""
    rel = file[len(folder) + 1 :] if file.startswith(folder + "/") else file.rsplit("/", 1)[-1]
    return rel.split("/", 1)[0] if "/" in rel else ""
