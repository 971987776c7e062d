"""Best-k bookkeeping of ``AsyncCheckpointCallback``: which cuts enter the top k, and which committed ones are best.

The requested view (not known to have failed) decides whether a new cut enters the top k; the committed view
gives ``best_k_models`` and ``best_model_path`` and what retention keeps, so a generation counts as best only once
committed. Ties go to the older generation. Pure bookkeeping on the training thread: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Entry", "TopK", "kth_best", "model_checkpoint_score"]


@dataclass
class Entry:
    """One requested generation.

    Attributes:
        step: Its step.
        score: The monitored value at the cut (``None``: not ranked, e.g. a final or last-only checkpoint).
        filename: The rendered ``filename`` template (recorded in the manifest).
        epoch: The epoch at the cut.
        path: The loadable checkpoint path, once committed.
        foreign: Restored from another location (the run this fit branched from): ranked, never removed.
        planned: The path it will have once committed (set at the cut, for the state written into it).
        supersedes: The step of the ranked entry of the same name it replaces (``enable_version_counter=False``:
            ``ModelCheckpoint`` overwrites that file and its ``best_k_models`` entry).
    """

    step: int
    score: float | None
    filename: str
    epoch: int = 0
    path: str = ""
    foreign: bool = False
    planned: str = ""
    supersedes: int | None = None

    @property
    def committed(self) -> bool:
        """Whether the generation's manifest was written."""
        return bool(self.path)

    @property
    def location(self) -> str:
        """Its path once committed, else the path it is planned at."""
        return self.path or self.planned


def model_checkpoint_score(score: float, mode: str) -> float:
    """``ModelCheckpoint``'s record of a monitored value: NaN becomes the worst value, +inf (min) or -inf (max)."""
    return (math.inf if mode == "min" else -math.inf) if math.isnan(score) else score


def kth_best(best: list[Entry]) -> Entry:
    """``ModelCheckpoint``'s k-th best of ``best`` (best first): the worst score, the oldest of a tie (its
    ``max``/``min`` over ``best_k_models`` returns the first inserted)."""
    worst = best[-1].score
    return min((e for e in best if e.score == worst or e is best[-1]), key=lambda e: e.step)


class TopK:
    """The requested and committed top ``k`` by ``mode`` (``k=-1``: all ranked entries)."""

    def __init__(self, k: int, mode: str) -> None:
        self.k = k
        self.mode = mode
        self.entries: dict[int, Entry] = {}

    def __eq__(self, other: object) -> bool:
        # By value, like ModelCheckpoint's plain attributes: a pickled copy of the callback equals the original.
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    # -- ranking -----------------------------------------------------------------------------------------
    def _key(self, entry: Entry) -> tuple[float, int]:
        score = float(entry.score)  # type: ignore[arg-type]
        if math.isnan(score):  # like ModelCheckpoint: NaN ranks last
            score = math.inf if self.mode == "min" else -math.inf
        return (score if self.mode == "min" else -score, entry.step)

    def _superseded(self, committed_only: bool, extra: Entry | None = None) -> set[int]:
        """Steps replaced by a live entry of the same name (in the committed view: once the replacement committed)."""
        live = [*self.entries.values(), *([extra] if extra is not None else [])]
        return {e.supersedes for e in live if e.supersedes is not None and (e.committed or not committed_only)}

    def _top(self, committed_only: bool, extra: Entry | None = None) -> list[Entry]:
        """The top k, best first, of the committed or requested entries (plus ``extra``, not yet requested)."""
        gone = self._superseded(committed_only, extra)
        pool = [e for e in self.entries.values() if extra is None or e.step != extra.step]
        ranked = [
            e
            for e in (*pool, *([extra] if extra is not None else []))
            if e.score is not None and (e.committed or not committed_only) and e.step not in gone
        ]
        ranked.sort(key=self._key)
        return ranked if self.k < 0 else ranked[: self.k]

    def prospective(self, entry: Entry) -> list[Entry]:
        """The top k, best first, once every requested save and ``entry`` commit (``ModelCheckpoint``'s view when
        it writes ``entry``'s file)."""
        return self._top(committed_only=False, extra=entry)

    def enters(self, score: float | None) -> bool:
        """Whether a cut scoring ``score`` enters the requested top k (``ModelCheckpoint.check_monitor_top_k``)."""
        if score is None or self.k == 0:
            return False
        top = self._top(committed_only=False)
        if self.k < 0 or len(top) < self.k:
            return True
        worst = float(top[-1].score)  # type: ignore[arg-type]
        if math.isnan(worst):
            worst = math.inf if self.mode == "min" else -math.inf
        return score < worst if self.mode == "min" else score > worst

    # -- lifecycle ---------------------------------------------------------------------------------------
    def requested(self, entry: Entry) -> None:
        """A cut was admitted."""
        self.entries[entry.step] = entry

    def failed(self, step: int) -> None:
        """The save of ``step`` ended without a commit: it never counts."""
        self.entries.pop(step, None)

    def committed(self, step: int, path: str) -> Entry | None:
        """The save of ``step`` committed at ``path``."""
        entry = self.entries.get(step)
        if entry is not None:
            entry.path = path
        return entry

    def removed(self, step: int) -> None:
        """Generation ``step`` was removed from storage."""
        self.entries.pop(step, None)

    # -- the committed view ------------------------------------------------------------------------------
    def best(self) -> list[Entry]:
        """The committed top k, best first."""
        return self._top(committed_only=True)

    def newest(self, n: int) -> list[Entry]:
        """The ``n`` newest committed entries of this location (of the foreign ones while it has none)."""
        if n <= 0:
            return []
        committed = [e for e in self.entries.values() if e.committed]
        own = [e for e in committed if not e.foreign]
        return sorted(own or committed, key=lambda e: e.step)[-n:]

    def moved(self) -> None:
        """The fit writes to another location than these entries' (a second fit into a new version): they stay
        ranked, like ``ModelCheckpoint``'s remembered ``best_k_models``, but are never removed nor this location's
        newest."""
        for entry in self.entries.values():
            entry.foreign = True

    def to_remove(self, keep_newest: int) -> list[int]:
        """Committed steps neither in the committed top k nor among the ``keep_newest`` newest (oldest first)."""
        keep = {e.step for e in self.best()} | {e.step for e in self.newest(max(1, keep_newest))}
        return sorted(e.step for e in self.entries.values() if e.committed and e.step not in keep)

    def same_name(self, filename: str) -> Entry | None:
        """The newest ranked live entry named ``filename`` (what a save of that name replaces without a version
        counter)."""
        same = [e for e in self.entries.values() if e.filename == filename and e.score is not None]
        return max(same, key=lambda e: e.step, default=None)

    def name_in_use(self, filename: str, *, but: Entry | None = None) -> bool:
        """Whether a live entry other than ``but`` carries ``filename`` (for ``enable_version_counter``)."""
        return any(e.filename == filename and e is not but for e in self.entries.values())

    def replaced(self, *, monitored: bool) -> Entry | None:
        """The entry a new save displaces in ``ModelCheckpoint``'s terms: the k-th best of a full top k, or, without
        a monitor, the newest one (whose name ``ModelCheckpoint`` may overwrite)."""
        if not monitored:
            return max(self.entries.values(), key=lambda e: e.step, default=None)
        top = self._top(committed_only=False)
        return top[-1] if 0 < self.k == len(top) else None
