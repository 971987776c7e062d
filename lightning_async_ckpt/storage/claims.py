"""Writer claims: who writes a generation, and the lease that proves a writer is still alive.

Each writing process of an attempt holds an attempt claim ``.writer-<token>-r<rank>.json`` (created exclusively,
renewed while it writes: :class:`Lease`); the attempt that may use the step's plain names also holds the step claim
``.writer.json``. A claim is live until ``expires`` plus ``CLOCK_SKEW_S``; host name and pid are never proof of
death, and a claim without ``expires`` is never provably dead (:attr:`Liveness.UNKNOWN`).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.storage.io import atomic_local_write
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.root import StoreRoot
    from lightning_async_ckpt.storage.view import StoreView

__all__ = [
    "CLAIM_NAME",
    "CLOCK_SKEW_S",
    "LEASE_S",
    "RENEW_S",
    "Lease",
    "Liveness",
    "attempt_claim_name",
    "claim_body",
    "claim_liveness",
    "clear_leftovers",
    "is_claim_name",
    "is_takeover_marker",
    "leftover_writers",
    "new_token",
    "read_claim",
    "take_step_claim",
    "token_liveness",
    "written_beside",
]

_log = logging.getLogger(__name__)

#: The step claim: the writer holding it writes the generation's objects at their plain names.
CLAIM_NAME = ".writer.json"
#: Seconds a claim stays live without being renewed.
LEASE_S = 120.0
#: A writer renews its lease at its next write once this many seconds passed since the last renewal.
RENEW_S = 15.0
#: Allowance for the clocks of other hosts: a lease is expired only this long after its ``expires``.
CLOCK_SKEW_S = 60.0

_ATTEMPT_RE = re.compile(r"^\.writer-([0-9a-f]+)-r([0-9]+)\.json$")
_MAX_CLAIM_BYTES = 64 << 10


class Liveness(enum.Enum):
    """What a claim says about its writer."""

    LIVE = "live"  # the lease has not expired
    EXPIRED = "expired"  # the lease expired: the writer stopped renewing it (dead, or frozen)
    UNKNOWN = "unknown"  # no lease (an older version's claim) or unreadable: never provably dead


def attempt_claim_name(token: str, rank: int) -> str:
    """File name of the attempt claim of ``rank`` in the attempt ``token``."""
    return f".writer-{token}-r{rank}.json"


def is_claim_name(name: str) -> bool:
    """Whether a file name (no folder) is a step claim or an attempt claim."""
    return name == CLAIM_NAME or _ATTEMPT_RE.match(name) is not None


def claim_body(run_id: str, step: int, token: str, *, rank: int = 0, lease_s: float = LEASE_S) -> bytes:
    """The bytes of a claim: who writes the step, and until when the claim is live without renewal."""
    now = time.time()
    body = {"run_id": run_id, "step": step, "token": token, "rank": rank, "host": socket.gethostname()}
    return json.dumps({**body, "pid": os.getpid(), "started": now, "expires": now + lease_s}).encode()


def claim_liveness(body: dict[str, Any], now: float | None = None) -> Liveness:
    """Whether a claim's writer is provably alive, provably gone (its lease expired) or neither."""
    expires = body.get("expires")
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        return Liveness.UNKNOWN
    now = time.time() if now is None else now
    return Liveness.LIVE if now <= expires + CLOCK_SKEW_S else Liveness.EXPIRED


def read_claim(fs: Any, path: str) -> dict[str, Any] | None:
    """The parsed body of the claim at ``path``, or ``None`` when it is missing, torn or not a claim."""
    try:
        body = json.loads(fs.cat_file(path, start=0, end=_MAX_CLAIM_BYTES))
    except Exception:  # noqa: BLE001 - missing, unreadable or torn: the caller decides what unknown means
        return None
    return body if isinstance(body, dict) else None


def token_liveness(store: StoreRoot, folder: str, token: str) -> Liveness:
    """The liveness of attempt ``token`` in generation ``folder``: live if any of its claims is live.

    Every claim of the attempt counts (the step claim and each rank's attempt claim, renewed while it writes);
    the attempt is :attr:`Liveness.EXPIRED` only when every one of them expired.
    """
    try:
        files = store.fs.find(folder)
    except Exception:  # noqa: BLE001 - an unlistable folder proves nothing
        return Liveness.UNKNOWN
    seen = Liveness.EXPIRED
    for path in files:
        if not is_claim_name(path.rstrip("/").rsplit("/", 1)[-1]):
            continue
        body = read_claim(store.fs, path)
        if body is None or body.get("token") != token:
            continue
        state = claim_liveness(body)
        if state is Liveness.LIVE:
            return state
        if state is Liveness.UNKNOWN:
            seen = state
    return seen


class Lease:
    """One process's attempt claim, renewed while it writes.

    Call sequence: :meth:`create` before the first object, :meth:`renew` at each write (it rewrites the claim
    at most every ``RENEW_S`` seconds), :meth:`release` when this process's part of the attempt ended. A claim
    that vanished (removed by retention or by an operator) is never recreated: :attr:`lost` tells.

    Thread-safety: ``renew`` may be called from several writing threads; a renewal that runs while another is
    in progress is skipped.

    Args:
        store: The store.
        path: The claim's path (``<generation>/<prefix>.writer-<token>-r<rank>.json``).
        step: The generation's step.
        token: The attempt's token.
        rank: This process's rank in the attempt (0 for a single writer).
    """

    def __init__(self, store: StoreView, path: str, step: int, token: str, rank: int = 0) -> None:
        self.store = store
        self.path = path
        self.step = step
        self.token = token
        self.rank = rank
        self.lost = False
        self._renewed = 0.0
        self._busy = False

    def body(self) -> bytes:
        """The claim's current bytes (a fresh expiry)."""
        return claim_body(self.store.run_id, self.step, self.token, rank=self.rank)

    def create(self) -> None:
        """Create the claim exclusively.

        Raises:
            FileExistsError: A claim is at the path (never, for a fresh token).
        """
        self.store.backend.create_claim(self.path, self.body())
        self._renewed = time.monotonic()

    def renew(self, *, force: bool = False) -> None:
        """Push the expiry forward when ``RENEW_S`` seconds passed (or ``force``); never raises."""
        now = time.monotonic()
        if self.lost or self._busy or (not force and now - self._renewed < RENEW_S):
            return
        self._busy = True
        try:
            self._renewed = now
            if not self.store.fs.exists(self.path):
                self.lost = True
                _log.warning("the claim %s was removed while its writer was writing", self.path)
                return
            if self.store.is_local:
                atomic_local_write(self.path, self.body())
            else:
                with self.store.fs.open(self.path, "wb") as f:
                    f.write(self.body())
        except Exception:  # noqa: BLE001 - a failed renewal only makes the claim expire sooner
            _log.debug("could not renew the claim %s", self.path, exc_info=True)
        finally:
            self._busy = False

    def release(self) -> None:
        """Remove the claim (idempotent; never raises)."""
        self.lost = True
        try:
            self.store.fs.rm_file(self.path)
        except FileNotFoundError:
            pass
        except Exception:  # noqa: BLE001 - an expired claim left behind is collected by retention
            _log.debug("could not remove the claim %s", self.path, exc_info=True)


def take_step_claim(store: StoreRoot, folder: str, body: bytes) -> bool:
    """Create the step claim of ``folder`` for a new attempt, or take it over from an attempt that is gone.

    Takeover needs proof of death (every claim of the holding attempt expired, :func:`token_liveness`) and is done only
    on local disks, after :func:`clear_leftovers`; on object stores the new attempt writes under its own prefix. Of two
    takers, the one that creates ``.writer-<old token>.taken`` exclusively wins.

    Returns:
        Whether this attempt now holds the step claim.
    """
    claim = f"{folder}/{CLAIM_NAME}"
    try:
        store.backend.create_claim(claim, body)
        return True
    except FileExistsError:
        pass
    if not store.is_local:
        return False
    held = read_claim(store.fs, claim)
    token = held.get("token") if held else None
    if not isinstance(token, str) or token_liveness(store, folder, token) is not Liveness.EXPIRED:
        return False
    try:
        store.backend.create_claim(f"{folder}/.writer-{token}.taken", body)
    except FileExistsError:
        return False  # another writer is taking it over
    now = read_claim(store.fs, claim)
    if now is None or now.get("token") != token:
        return False
    store.fs.rm_file(claim)
    try:
        store.backend.create_claim(claim, body)
    except FileExistsError:
        return False
    _log.warning("took over generation %s from writer %s, whose lease expired", folder, token)
    return True


def clear_leftovers(store: StoreRoot, folder: str, keep: set[str]) -> list[str]:
    """Before an attempt writes plain names: remove what earlier attempts left at them.

    Every file of ``folder`` goes except ``keep``, other writers' ``w-<token>/`` folders and live attempt claims, so a
    late writer of an earlier attempt writes to an orphaned inode. Files with no earlier attempt's claim beside them
    were not written by the library: nothing is removed, and they are returned (the attempt then writes under its own
    prefix, :func:`claim_step`).
    """
    try:
        files = store.fs.find(folder)
    except FileNotFoundError:
        return []
    names = [_relative(p, folder) for p in files]
    others = [rel for rel in names if rel not in keep and not rel.startswith("w-")]
    if others and not any(is_claim_name(rel) or is_takeover_marker(rel) for rel in others):
        return others
    removed = False
    for path in files:
        rel = _relative(path, folder)
        name = rel.rsplit("/", 1)[-1]
        if rel in keep or rel.startswith("w-"):
            continue
        if is_claim_name(name):
            body = read_claim(store.fs, path)
            if body is None or claim_liveness(body) is not Liveness.EXPIRED:
                continue
        try:
            store.fs.rm_file(path)
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        store.backend.sync_folder(folder)
        store.invalidate_cache()
    return []


def new_token() -> str:
    """A random attempt token."""
    return uuid.uuid4().hex[:12]


def is_takeover_marker(name: str) -> bool:
    """Whether a file name (no folder) is the marker ``.writer-<token>.taken`` of a takeover (:func:`take_step_claim`)."""
    return name.startswith(".writer-") and name.endswith(".taken")


def written_beside(file: str, folder: str, keys: set[str]) -> bool:
    """Whether ``file`` (in generation ``folder``) is one the library wrote there: an object of the manifest
    (``keys``), or outside a prefix a claim, a takeover marker or the manifest; other files are left alone."""
    rel = _relative(file, folder)
    if rel in keys:
        return True
    if "/" in rel:
        return False
    return is_claim_name(rel) or rel == MANIFEST_NAME or is_takeover_marker(rel)


def leftover_writers(store: StoreView, step: int, mtime: float | None) -> tuple[tuple[str, ...], float | None]:
    """The writers whose claims are in uncommitted generation ``step`` (run ids; ``"?"`` unreadable; marked when
    still live), and seconds since the newest claim (or ``mtime``) was written."""
    path = store.generation_path(step)
    try:
        files = store.fs.find(path)
    except Exception:  # noqa: BLE001 - an unlistable leftover has an unknown writer
        return ("?",), None
    writers, started = [], []
    for f in files:
        if not is_claim_name(f.rstrip("/").rsplit("/", 1)[-1]):
            continue
        body = read_claim(store.fs, f)
        try:
            started.append(float(body["started"]))  # type: ignore[index]
            writers.append(str(body["run_id"]) + (" (a live process)" if _live(body) else ""))  # type: ignore[index]
        except Exception:  # noqa: BLE001 - a torn claim names an unknown writer
            writers.append("?")
    when = max(started) if started else mtime
    return tuple(writers), (time.time() - when) if when is not None else None


def _live(claim: dict) -> bool:
    """Whether a claim's writer may still be writing: its lease has not expired; for a claim without a lease
    (written by an older version), another process of this host that is still running."""
    state = claim_liveness(claim)
    if state is not Liveness.UNKNOWN:
        return state is Liveness.LIVE
    pid = claim.get("pid")
    if claim.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _relative(file: str, folder: str) -> str:
    """``file``'s path below generation ``folder`` (its bare name when it is not below it)."""
    return file[len(folder) + 1 :] if file.startswith(folder + "/") else file.rsplit("/", 1)[-1]
