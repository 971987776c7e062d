"""What a store knows of its folder between retention passes, so a pass after a commit reads O(1) manifests.

A committed manifest is never written over, so once read it stays true until its name leaves the listing: a pass
lists the folder once and reads only the manifests of names it does not know as committed.

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

    def first_report(self, step: int) -> bool:
        """Whether ``step``'s foreign files are reported for the first time by this store (then once only)."""
        with self._lock:
            first = step not in self._reported
            self._reported.add(step)
            return first

    def refresh(self, store: StoreRoot) -> tuple[list[GenerationInfo], set[int]]:
        """List ``store``'s folder once; return its generations by step and the steps whose manifest was read now.

        Raises:
            StoreUnavailableError: The folder cannot be listed.
        """
        steps = finder.list_steps(store).steps
        with self._lock:
            known = dict(self._known)
        out, read = [], set()
        for step in steps:
            info = known.get(step)
            if info is None or not info.committed:
                info = self.reread(store, step)
                read.add(step)
            out.append(info)
        with self._lock:
            self._known = {info.step: _slim(info) for info in out}
        return out, read

    def learn(self, infos: list[GenerationInfo]) -> None:
        """Take a listing the caller has just read in full (every manifest) as what the folder holds."""
        with self._lock:
            self._known = {info.step: _slim(info) for info in infos if info.committed}

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
