"""S3 multipart uploads that no live attempt owns: found under a store's generations and aborted.

A writer killed mid-upload leaves its multipart upload open (billed, unlisted). A store's :class:`Sweeper` lists the
uploads under its prefix on its first ``begin``, at ``retain``/``gc`` and at most every ``every_s`` seconds; nothing
on other backends. :func:`decide` (pure) aborts an upload inside a committed generation's prefix, or whose attempt's
claims all expired, or under plain names nobody claims once older than ``grace_s``; it keeps one whose attempt is
live or whose liveness cannot be told.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_async_ckpt.storage.claims import CLAIM_NAME, Liveness, read_claim, token_liveness
from lightning_async_ckpt.storage.generation import parse_generation_name
from lightning_async_ckpt.storage.manifest import SPREAD_FOLDER

if TYPE_CHECKING:
    from lightning_async_ckpt.storage.manifest import Manifest
    from lightning_async_ckpt.storage.root import StoreRoot

__all__ = ["DEFAULT_GRACE_S", "DEFAULT_EVERY_S", "OpenUpload", "SweepReport", "Sweeper", "decide", "open_uploads"]

_log = logging.getLogger(__name__)
#: Uploads under plain names that no step claim covers are aborted once this old (seconds).
DEFAULT_GRACE_S = 3600.0
#: A store sweeps again from ``begin``/``gc`` at most this often (seconds); an operator ``gc`` always sweeps.
DEFAULT_EVERY_S = 600.0


@dataclass(frozen=True)
class OpenUpload:
    """One open multipart upload under a store's generations.

    Attributes:
        key: The object key (no bucket).
        upload_id: S3's id of the upload.
        age_s: Seconds since it was initiated (S3's clock against this host's).
        step: The generation it writes into.
        prefix: The attempt's prefix inside the generation (``""`` or ``"w-<token>/"``).
    """

    key: str
    upload_id: str
    age_s: float
    step: int
    prefix: str


@dataclass
class SweepReport:
    """What a sweep did: ``aborted`` uploads, ``kept`` ones with the reason, ``failed`` aborts with the error."""

    aborted: list[OpenUpload] = field(default_factory=list)
    kept: list[tuple[OpenUpload, str]] = field(default_factory=list)
    failed: list[tuple[OpenUpload, str]] = field(default_factory=list)


def decide(
    upload: OpenUpload,
    *,
    grace_s: float,
    committer_prefixes: frozenset[str] | None,
    liveness: Liveness | None,
) -> str | None:
    """Why ``upload`` is kept, or ``None`` to abort it (pure; the rules are in the module docstring).

    Args:
        upload: The upload.
        grace_s: Minimum age of an upload under plain names that no step claim covers before it is aborted.
        committer_prefixes: For a committed generation, the prefixes its manifest's objects are under; else ``None``.
        liveness: Its attempt's liveness; ``None`` when no claim names its attempt (no step claim for plain names).
    """
    if committer_prefixes is not None and upload.prefix in committer_prefixes:
        return None
    if liveness is Liveness.LIVE:
        return "its writer's lease is live"
    if liveness is Liveness.UNKNOWN:
        return "its writer's liveness cannot be told (a claim without a lease)"
    if liveness is Liveness.EXPIRED:
        return None
    if upload.age_s < grace_s:
        return f"no claim covers it, and it is younger than the {grace_s:g}s grace"
    return None


def open_uploads(store: StoreRoot) -> list[OpenUpload]:
    """The open multipart uploads under ``store``'s generations (none on backends other than S3)."""
    if store.backend.kind != "s3":
        return []
    bucket, _, base = store.root.partition("/")
    prefix = f"{base}/" if base else ""
    found, kwargs = [], {"Bucket": bucket, "Prefix": prefix}
    now = time.time()
    while True:
        page = store.fs.call_s3("list_multipart_uploads", **kwargs)
        for upload in page.get("Uploads", []) or []:
            folder, _, rest = upload["Key"][len(prefix) :].partition("/")
            if folder == SPREAD_FOLDER:  # spread/<h>/step-N/<file>: the generation's plain names (token in file)
                folder, _, rest = rest.partition("/")[2].partition("/")
                rest = rest if "/" not in rest else ""
            step = parse_generation_name(folder)
            if step is None or not rest:
                continue
            first, sep, _ = rest.partition("/")
            attempt = f"{first}/" if sep and first.startswith("w-") else ""
            found.append(OpenUpload(upload["Key"], upload["UploadId"], now - _timestamp(upload), step, attempt))
        if not page.get("IsTruncated"):
            return found
        kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))


class Sweeper:
    """When a store sweeps its orphaned multipart uploads, and the sweep itself.

    Thread-safety: any thread; one sweep runs at a time per store (a sweep that would overlap is skipped).

    Args:
        grace_s: See :func:`decide`.
        every_s: A store's ``begin``/``gc`` sweep again at most this often.
    """

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, every_s: float = DEFAULT_EVERY_S) -> None:
        self.grace_s = grace_s
        self.every_s = every_s
        self.last: SweepReport | None = None  # the latest sweep's report
        self._at: float | None = None
        self._lock = threading.Lock()

    def maybe(self, store: StoreRoot, *, force: bool = False) -> SweepReport | None:
        """Sweep when due (or ``force``); never raises: a sweep that fails is logged and tried next time."""
        if store.backend.kind != "s3":
            return None
        now = time.monotonic()
        if not force and self._at is not None and now - self._at < self.every_s:
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._at = now
            self.last = self.sweep(store)
            return self.last
        except Exception:  # noqa: BLE001 - cleanup never fails a save; the next sweep retries
            _log.warning("could not sweep the multipart uploads under %s", store.uri, exc_info=True)
            return None
        finally:
            self._lock.release()

    def sweep(self, store: StoreRoot) -> SweepReport:
        """Abort the open multipart uploads under ``store`` that belong to no live attempt (module docstring).

        Raises:
            Exception: The uploads cannot be listed. A failed abort is only reported (``failed``).
        """
        report = SweepReport()
        uploads = open_uploads(store)
        if not uploads:
            return report
        bucket = store.root.partition("/")[0]
        committed: dict[int, frozenset[str] | None] = {}
        attempts: dict[tuple[int, str], Liveness | None] = {}
        for upload in uploads:
            if upload.step not in committed:
                info = store.read_generation(upload.step)
                committed[upload.step] = _prefixes(info.manifest) if info.committed and info.manifest else None
            where = (upload.step, upload.prefix)
            if where not in attempts:
                attempts[where] = _liveness(store, upload)
            reason = decide(
                upload,
                grace_s=self.grace_s,
                committer_prefixes=committed[upload.step],
                liveness=attempts[where],
            )
            if reason is not None:
                report.kept.append((upload, reason))
                continue
            try:
                store.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload.key, UploadId=upload.upload_id)
            except Exception as exc:  # noqa: BLE001 - reported; the next sweep tries again
                _log.warning("could not abort the multipart upload of s3://%s/%s: %s", bucket, upload.key, exc)
                report.failed.append((upload, f"{type(exc).__name__}: {exc}"))
                continue
            _log.info("aborted the multipart upload of s3://%s/%s: no live writer owns it", bucket, upload.key)
            report.aborted.append(upload)
        return report


def _liveness(store: StoreRoot, upload: OpenUpload) -> Liveness | None:
    folder = store.generation_path(upload.step)
    if upload.prefix:
        token = upload.prefix.removeprefix("w-").rstrip("/")
    else:
        body = read_claim(store.fs, f"{folder}/{CLAIM_NAME}")
        token = body.get("token") if body else None
        if not isinstance(token, str):
            return None
    return token_liveness(store, folder, token)


def _prefixes(manifest: Manifest) -> frozenset[str]:
    out = set()
    for obj in manifest.objects:
        first, sep, _ = obj.key.partition("/")
        out.add(f"{first}/" if sep and first.startswith("w-") else "")
    return frozenset(out)


def _timestamp(upload: dict[str, Any]) -> float:
    value = upload.get("Initiated")
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return time.time()  # unknown: as young as can be (never aborted for its age)
