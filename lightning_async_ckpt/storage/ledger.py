"""What a store knows of its folder between retention passes, so that no pass reads every manifest.

A committed manifest is never written over (a generation is removed manifest first, then data), so once read it
stays true until its name leaves the listing. The ledger keeps what a pass read and what this store's writers
committed; each pass lists the folder once (names only) and walks it newest first, reading only the manifests of
names it does not know as committed: new generations of other writers, and folders that were uncommitted last time
(a save in progress may have committed since).

**The lineage.** Names give steps, so a walk for one run ends where that run's lineage ends: below what earlier
passes looked at, at the first committed generation of another run that is older than one of this run's (it is
read, and it is the last one read). A run continues a folder on top of what was there (a restarted job resumes its
newest generation, another run starts above the old ones), so what lies below is not this run's and is neither
read nor touched: a new store's first pass (another run's ``keep_last`` pass, a restarted job) reads the
generations above that boundary, whatever the number below it. Names above it are looked at on every pass, so two
runs interleaving their steps in one folder still retire their own generations written since; only generations of
a run that lie below another run's, older than its store's first pass, are left to ``gc --run-id`` (which reads the
whole folder). A walk for all runs reads every name. Retention re-reads the manifests of the generations it counts
as kept and of those it removes before acting (:mod:`.retention`).

Thread-safety: any thread; passes and commits may interleave (a commit a pass missed is read by the next pass).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from lightning_async_ckpt.storage import finder
from lightning_async_ckpt.storage.generation import GenerationInfo
from lightning_async_ckpt.storage.manifest import Manifest

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.root import StoreRoot

__all__ = ["Ledger"]


class Ledger:
    """The generations a store saw in its folder, by step (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[int, GenerationInfo] = {}
        self.reads = 0  # manifests read by passes (for tests and benchmarks)
        self._reported: set[int] = set()
        self._ours: set[int] = set()
        # Per run id (None: all runs), the lowest step a walk looked at: every listed name above it was looked at.
        self._floors: dict[str | None, int] = {}

    def first_report(self, step: int) -> bool:
        """Whether ``step``'s foreign files are reported for the first time by this store (then once only)."""
        with self._lock:
            first = step not in self._reported
            self._reported.add(step)
            return first

    def refresh(self, store: StoreRoot, run_id: str | None = None) -> tuple[list[GenerationInfo], set[int]]:
        """List ``store``'s folder once and walk it newest first (module docstring).

        Args:
            store: The folder.
            run_id: End the walk at this run's lineage; ``None``: look at every name (a pass for all runs).

        Returns:
            The generations looked at, by step, and the steps whose manifest was read now.

        Raises:
            StoreUnavailableError: The folder cannot be listed.
        """
        steps = finder.list_steps(store).steps
        with self._lock:
            known = dict(self._known)
            floors = [f for f in (self._floors.get(run_id), self._floors.get(None)) if f is not None]
            floor = min(floors) if floors else None
        out: list[GenerationInfo] = []
        read: set[int] = set()
        seen_own = False
        for step in reversed(steps):
            info = known.get(step)
            if info is None or not info.committed:
                info = self.reread(store, step)
                read.add(step)
            out.append(info)
            if run_id is None or not info.committed:
                continue
            if info.run_id == run_id:
                seen_own = True
            elif seen_own and (floor is None or step <= floor):
                break  # the end of this run's lineage: older names are another run's history
        out.reverse()
        listed = set(steps)
        with self._lock:
            self._known = {s: i for s, i in self._known.items() if s in listed}
            if out:
                low = out[0].step
                self._floors[run_id] = low if floor is None else min(floor, low)
        return out, read

    def learn(self, infos: list[GenerationInfo]) -> None:
        """Take a listing the caller has just read in full (every manifest) as what the folder holds."""
        with self._lock:
            self._known = {info.step: _slim(info) for info in infos if info.committed}
            if infos:
                self._floors = {None: min(info.step for info in infos)}  # every name was looked at, for every run

    def reread(self, store: StoreRoot, step: int) -> GenerationInfo:
        """Read generation ``step``'s manifest again and remember what it says."""
        info = store.read_generation(step)
        with self._lock:
            self.reads += 1
            if info.committed:
                self._known[step] = _slim(info)
            else:
                self._known.pop(step, None)
        return info

    def committed(self, store: StoreRoot, manifest: Manifest) -> None:
        """Remember a generation this store's writer just committed (the next pass does not read it)."""
        info = GenerationInfo(
            step=manifest.step,
            path=store.url(manifest.step),
            committed=True,
            manifest=manifest,
            mtime=manifest.committed_at,
        )
        with self._lock:
            self._known[manifest.step] = _slim(info)

    def removed(self, step: int) -> None:
        """Forget a generation retention removes (called before the removal starts; :attr:`ours` keeps it)."""
        with self._lock:
            self._known.pop(step, None)
            self._ours.add(step)

    def wrote(self, step: int) -> None:
        """This store's writer of ``step`` ended (committed, failed or aborted)."""
        with self._lock:
            self._ours.add(step)

    @property
    def ours(self) -> frozenset[int]:
        """Steps this store wrote or began removing: a failed attempt, or a removal that stopped after the
        manifest, leaves the library's files without a manifest or claim, which the next pass may still collect."""
        with self._lock:
            return frozenset(self._ours)


def _slim(info: GenerationInfo) -> GenerationInfo:
    """What a pass needs of a generation it does not re-read (step, run id, time): no object list is kept, so
    the ledger stays small however many ranks' objects each manifest lists. Generations a pass acts on (this
    run's: kept or removed) are read again in full."""
    manifest = info.manifest
    if manifest is None:
        return info
    head = Manifest(
        step=manifest.step,
        run_id=manifest.run_id,
        objects=(),
        committed_at=manifest.committed_at,
        format_version=manifest.format_version,
    )
    return dataclasses.replace(info, manifest=head)
