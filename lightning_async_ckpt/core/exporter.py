"""Exports of chosen generations in the background: which ones (:class:`SafetensorsExport`) and the thread that
writes them (:class:`Exporter`, a commit callback).
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any

from lightning_async_ckpt.core.commit_hooks import Committed
from lightning_async_ckpt.core.export import EXPORT_FORMAT, export_location, export_safetensors, parse_dtype
from lightning_async_ckpt.errors import CheckpointError, ConfigError, ManifestError
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore

__all__ = ["ExportError", "Exporter", "SafetensorsExport", "check_export"]

_log = logging.getLogger("lightning_async_ckpt")
_GENERATION = re.compile(r"^step-\d{8,}$")


class ExportError(CheckpointError):
    """An export failed; the generation it was made from is committed all the same, the export left no manifest."""


@dataclass(frozen=True)
class SafetensorsExport:
    """Which committed generations are exported to safetensors, and how.

    Only generations committed on the durable tier are exported (with ``local_dirpath``: after their promotion).

    Attributes:
        final: Export the newest generation when training ends (``Exporter.finish``).
        best: Export each generation that is the best when it commits (Lightning's ``monitor``).
        every_n: Export every N-th durable generation (``None``: none on a cadence).
        dtype: Cast floating-point weights (``"bfloat16"``, ``"float16"``, ``"float32"``; ``None``: as saved).
        max_shard_size: Bytes per file; above it, shards and ``model.safetensors.index.json``.
        model_key: The checkpoint entry holding the model's state dict (default: ``state_dict``, ``model``).
        strip_prefix: Removed from every tensor name (``"model."`` for an HF model kept as ``self.model``).
        dirpath: Where the exports are committed (default: ``<dirpath>/exports/safetensors``).
        storage_options: fsspec options of the stores read and written (default: the checkpoint store's).
    """

    final: bool = True
    best: bool = False
    every_n: int | None = None
    dtype: str | None = None
    max_shard_size: int = 5 << 30
    model_key: str | None = None
    strip_prefix: str | None = None
    dirpath: str | None = None
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.every_n is not None and (isinstance(self.every_n, bool) or not isinstance(self.every_n, int)):
            raise ConfigError(f"every_n must be None or an int >= 1, got {self.every_n!r}")
        if self.every_n is not None and self.every_n < 1:
            raise ConfigError(f"every_n must be None or an int >= 1, got {self.every_n!r}")
        if isinstance(self.max_shard_size, bool) or not isinstance(self.max_shard_size, int) or self.max_shard_size < 1:
            raise ConfigError(f"max_shard_size must be a positive number of bytes, got {self.max_shard_size!r}")


def check_export(export: Any) -> SafetensorsExport | None:
    """``export=`` of the callback: ``None``, ``"safetensors"`` (the final generation) or a :class:`SafetensorsExport`."""
    if export is None or isinstance(export, SafetensorsExport):
        return export
    if export == EXPORT_FORMAT:
        return SafetensorsExport()
    raise ConfigError(
        f"export must be None, {EXPORT_FORMAT!r} or a SafetensorsExport(...), got {export!r}: e.g. "
        "export=SafetensorsExport(best=True, dtype='bfloat16')"
    )


class Exporter:
    """Runs a :class:`SafetensorsExport` policy on one background thread; pass it as a commit callback.

    Example (plain loop)::

        exporter = Exporter(SafetensorsExport(every_n=10, dtype="bfloat16"))
        ckpt.add_commit_callback(exporter)
        ...  # the loop
        ckpt.close()
        exporter.finish()  # the final export, then waits; raises an export's failure

    Args:
        policy: Which generations, and how (default: the final one, as saved).
        report: Where failures go as they happen (an engine's ``report_error``: raised once at its next call);
            default: kept and raised by :meth:`finish`.
        storage_options: fsspec options when the policy has none.
    """

    def __init__(
        self, policy: SafetensorsExport | None = None, *, report: Any = None, storage_options: dict | None = None
    ) -> None:
        self.policy = policy or SafetensorsExport()
        self.report = report
        self.storage_options = self.policy.storage_options or storage_options or {}
        self.exported: list[Manifest] = []
        self._errors: list[BaseException] = []
        self._futures: dict[int, Future] = {}
        self._newest: Committed | None = None
        self._durable = 0
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, committed: Committed) -> None:
        """A commit callback (training thread): queue the export of ``committed`` when the policy says so."""
        if committed.tier != "durable" or committed.manifest.format == EXPORT_FORMAT:
            return
        self._newest = committed
        self._durable += 1
        every = self.policy.every_n
        if (self.policy.best and committed.is_best) or (every is not None and self._durable % every == 0):
            self.submit(committed)

    def submit(self, committed: Committed) -> Future:
        """Export ``committed`` in the background (once per step)."""
        if committed.step in self._futures:
            return self._futures[committed.step]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lightning_async_ckpt-export")
        future = self._pool.submit(self._export, committed)
        self._futures[committed.step] = future
        return future

    def _export(self, committed: Committed) -> Manifest | None:
        source, _, folder = committed.uri.rstrip("/").rpartition("/")
        policy = self.policy
        try:
            if not _GENERATION.match(folder):
                raise ConfigError(
                    f"{committed.uri} is not a generation of a checkpoint store (an accelerate save_state folder?): "
                    "export reads <store>/step-N generations; use attach(accelerator, uri) for those"
                )
            manifest = export_safetensors(
                source,
                committed.step,
                policy.dirpath or export_location(source),
                dtype=policy.dtype,
                max_shard_size=policy.max_shard_size,
                model_key=policy.model_key,
                strip_prefix=policy.strip_prefix,
                storage_options=self.storage_options,
            )
        except BaseException as exc:
            if not isinstance(exc, ConfigError) and _retired(source, committed.step, self.storage_options):
                _log.warning(
                    "step %d was removed by retention before its safetensors export finished: not exported (keep "
                    "more generations, keep_last / save_top_k, to export every one asked for)",
                    committed.step,
                )
                return None
            error = ExportError(f"safetensors export of step {committed.step} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            if self.report is not None:
                self.report(error)
            else:
                self._errors.append(error)
            raise error from exc
        _log.info("exported step %d to safetensors (%d bytes)", committed.step, manifest.total_bytes)
        self.exported.append(manifest)
        return manifest

    def finish(self, timeout: float | None = None) -> bool:
        """Queue the final export (``policy.final``), wait for every export; idempotent.

        Returns:
            Whether every export ended within ``timeout``.

        Raises:
            ExportError: An export failed and no ``report`` took it.
        """
        if self.policy.final and self._newest is not None:
            self.submit(self._newest)
        done, pending = wait_all(list(self._futures.values()), timeout=timeout)
        if pending:
            _log.warning(
                "%d safetensors export(s) still running after %ss: they commit or leave nothing", len(pending), timeout
            )
        if self._pool is not None and not pending:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error
        return not pending


def _retired(uri: str, step: int, storage_options: dict) -> bool:
    """Whether generation ``step`` is no longer committed in the store at ``uri`` (retention removed it)."""
    try:
        CheckpointStore(uri, storage_options, check_writable=False).manifest(step)
    except ManifestError:
        return True
    except Exception:  # noqa: BLE001 - cannot tell: the export's own error is reported
        return False
    return False
