"""Which tier :func:`~lightning_async_ckpt.accelerate.load_state` restores from with ``local_dirpath``.

Every process looks at its own local tier (a node-local folder: other nodes' folders hold nothing unless they are
shared or replicated), so every process takes part:

1. each process finds the newest intact generation of its ``local_dirpath`` and its version folders (every object
   re-read against its checksum; a damaged one is skipped with a warning), and the main process lists ``uri``
   (names only, nothing read);
2. when every process found the same step and ``uri`` lists no newer one, every process loads that step from its
   own folder; when they differ, each checks whether it holds the oldest of them intact, and all load it locally
   only when all do and ``uri`` lists nothing newer;
3. otherwise every process falls back to ``uri`` together (the main process chooses there, as with one tier).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_async_ckpt.accelerate._choose import Choice
from lightning_async_ckpt.core.collective import agree
from lightning_async_ckpt.storage.finder import list_steps
from lightning_async_ckpt.storage.generation import version_folders
from lightning_async_ckpt.storage.lookup import newest_intact
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["accept_accelerate", "choose_across_tiers", "holding_version", "skip_damaged", "version_store"]

_log = logging.getLogger("lightning_async_ckpt")


def choose_across_tiers(
    accelerator: Any,
    collective: Any,
    uri: str,
    local_dirpath: str,
    options: dict[str, Any],
    step: int | None,
) -> Choice | None:
    """Collective: this process's local generation every process agreed on, or ``None`` (every process loads from
    ``uri``).

    Raises:
        RankFailedError: Another process failed to look (its error is raised there).
        StoreUnavailableError: ``uri`` cannot be listed (main process).
    """
    error: BaseException | None = None
    mine: tuple[int, str] | None = None
    durable: int | None = None
    try:
        mine = _holding(local_dirpath, step) if step is not None else _newest(local_dirpath)
        if accelerator.is_main_process:
            durable = max(list_steps(CheckpointStore(uri, options, check_writable=False).location).steps, default=None)
    except Exception as exc:  # noqa: BLE001 - raised on every process by agree
        error = exc
    gathered = agree(collective, error, (mine, durable), doing="load_state: finding the local tier's newest step")
    durable = gathered[0][1]
    steps = [None if m is None else m[0] for m, _ in gathered]
    if any(s is None for s in steps):
        return _fallback(steps, durable, uri)
    agreed = min(s for s in steps if s is not None)
    if any(s != agreed for s in steps):
        error, mine = None, None
        try:
            mine = _holding(local_dirpath, agreed)
        except Exception as exc:  # noqa: BLE001 - raised on every process by agree
            error = exc
        held = agree(collective, error, mine is not None, doing=f"load_state: checking local step {agreed}")
        if not all(held):
            return _fallback([agreed if h else None for h in held], durable, uri)
    if durable is not None and durable > agreed:
        _log.info("load_state: %s lists step %d, newer than the local tier's %d: loading from it", uri, durable, agreed)
        return None
    assert mine is not None
    _log.info("load_state: every process resumes from its local tier, step %d (%s)", agreed, mine[1])
    return Choice(url=mine[1], step=agreed)


def _fallback(steps: list[int | None], durable: int | None, uri: str) -> None:
    lacking = [rank for rank, s in enumerate(steps) if s is None]
    if len(lacking) < len(steps):
        _log.warning(
            "load_state: process(es) %s lack the local generation the others hold intact: every process resumes "
            "from %s (step %s) together",
            lacking,
            uri,
            durable,
        )
    return None


def accept_accelerate(manifest: Manifest) -> bool:
    """Whether a local generation is one of accelerate's layout (the only kind ``load_state`` restores)."""
    return manifest.extra.get("layout") == "accelerate"


def skip_damaged(url: str, problems: tuple[str, ...]) -> None:
    """Warn (log and ``warnings``) that local generation ``url`` is skipped for ``problems``."""
    message = f"skipping local generation {url}: {'; '.join(problems)}"
    _log.warning("%s", message)
    warnings.warn(message, stacklevel=4)


def version_store(local_dirpath: str, version: int) -> CheckpointStore:
    """The store of version folder ``version`` of the local tier (``0``: ``local_dirpath`` itself)."""
    uri = f"{local_dirpath.rstrip('/')}/v{version}" if version else local_dirpath
    return CheckpointStore(uri, check_writable=False)


def holding_version(local_dirpath: str, step: int) -> int | None:
    """The version folder where this process's local tier holds ``step`` intact (the highest first), or ``None``."""
    root = CheckpointStore(local_dirpath, check_writable=False)
    for version in [*sorted(version_folders(root.fs, root.root), reverse=True), 0]:
        store = version_store(local_dirpath, version)
        if step not in list_steps(store.location).steps:
            continue
        result = store.verify(step)
        if result.ok and accept_accelerate(store.manifest(step)):
            return version
        skip_damaged(store.url(step), result.problems)
    return None


def _newest(local_dirpath: str) -> tuple[int, str] | None:
    found = newest_intact(local_dirpath, None, accept=accept_accelerate, on_skip=skip_damaged)
    if found is None:
        return None
    return found.info.step, found.store.url(found.info.step)


def _holding(local_dirpath: str, step: int) -> tuple[int, str] | None:
    """Where this process's local tier holds ``step`` intact (the highest version folder first), or ``None``."""
    version = holding_version(local_dirpath, step)
    return None if version is None else (step, version_store(local_dirpath, version).url(step))
