"""The stores a node-local tier holds, for ``ls`` / ``verify`` / ``gc --local-dirpath`` (``tier_commands``).

In ``local_dirpath`` and each version folder ``v<k>``: the single-writer generations, the DCP layout's per-rank
stores ``rank-<r>`` and its peer replicas ``replica-of-rank-<r>``. A local tier that cannot be listed raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.storage.generation import version_folders

__all__ = ["LocalStore", "local_stores", "unpromoted_guard"]

_RANK_RE = re.compile(r"^rank-([0-9]+)$")
_REPLICA_RE = re.compile(r"^replica-of-rank-([0-9]+)$")


@dataclass(frozen=True)
class LocalStore:
    """One store of the local tier.

    Attributes:
        uri: Its location.
        version: The version folder it is in (0: ``local_dirpath`` itself).
        rank: ``rank-<r>`` / ``replica-of-rank-<r>``'s ``r``; ``None`` for the single-writer store (the folder).
        replica: Whether it is a ``replica-of-rank-<r>`` folder (copies received from rank ``r``).
    """

    uri: str
    version: int
    rank: int | None
    replica: bool

    @property
    def name(self) -> str:
        """Its path relative to ``local_dirpath`` (``""`` for ``local_dirpath`` itself)."""
        head = f"v{self.version}" if self.version else ""
        if self.rank is None:
            return head
        leaf = f"replica-of-rank-{self.rank}" if self.replica else f"rank-{self.rank}"
        return f"{head}/{leaf}" if head else leaf


def local_stores(local_dirpath: str) -> list[LocalStore]:
    """Every store of the local tier at ``local_dirpath``: per version folder (ascending), the single-writer store
    (the folder itself) when it holds ``step-*`` entries or nothing else does, then its ``rank-<r>`` stores, then its
    ``replica-of-rank-<r>`` folders, each by rank.

    Raises:
        OSError: A folder of the tier cannot be listed (never read as empty).
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(local_dirpath)
    base = local_dirpath.rstrip("/")
    out: list[LocalStore] = []
    for version in [0, *version_folders(fs, root)]:
        path = root.rstrip("/") if version == 0 else f"{root.rstrip('/')}/v{version}"
        uri = base if version == 0 else f"{base}/v{version}"
        names = sorted(
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            for e in fs.ls(path, detail=True)
            if e.get("type") in ("directory", None)
        )
        ranks = sorted(int(m.group(1)) for m in map(_RANK_RE.match, names) if m)
        replicas = sorted(int(m.group(1)) for m in map(_REPLICA_RE.match, names) if m)
        if any(n.startswith("step-") for n in names) or (version == 0 and not ranks and not replicas):
            out.append(LocalStore(uri, version, None, False))
        out += [LocalStore(f"{uri}/rank-{r}", version, r, False) for r in ranks]
        out += [LocalStore(f"{uri}/replica-of-rank-{r}", version, r, True) for r in replicas]
    return out


def unpromoted_guard(local_steps: list[int], durable_rows: list[dict[str, Any]]) -> tuple[frozenset[int], str]:
    """The local steps ``gc`` keeps as the library's retention would (a generation due on the durable tier and not
    yet promoted is never removed), and why.

    The manifests do not record which local steps were due, so every committed local step newer than the durable
    tier's newest committed step is kept (a superset of what the writer keeps); ``("", frozenset())`` when none is.
    """
    durable = [r["step"] for r in durable_rows if r["committed"]]
    newest = max(durable, default=None)
    keep = frozenset(s for s in local_steps if newest is None or s > newest)
    if not keep:
        return keep, ""
    where = f"the durable tier's newest step {newest}" if newest is not None else "any durable step (none committed)"
    why = (
        f"newer than {where}: one may be due for promotion and not promoted yet, which retention never removes "
        "(the manifests do not record which steps were due, so all such steps are kept)"
    )
    return keep, why
