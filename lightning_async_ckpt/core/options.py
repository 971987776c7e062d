"""Engine options and the serializer role (what the upload thread writes into a generation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from lightning_async_ckpt.core.admission import AdmissionPolicy, validate_admission
from lightning_async_ckpt.core.guard import resolve_guard_mode
from lightning_async_ckpt.core.staging import resolve_budget
from lightning_async_ckpt.errors import ConfigError, check_number
from lightning_async_ckpt.storage.store import GenerationWriter

__all__ = ["CheckpointOptions", "Serializer", "TorchSaveSerializer"]


class Serializer(Protocol):
    """Writes a staged state into a generation.

    Call sequence: the engine calls :meth:`write` once per attempt on the upload thread, with a fresh writer; the
    serializer opens one or more objects with ``writer.open(name)``, streams into them and closes them. It must
    not commit: the engine writes the manifest afterwards.
    """

    def write(self, state: Any, writer: GenerationWriter) -> None:
        """Write ``state`` (whose tensors are staged host copies) as data objects."""
        ...


@dataclass(frozen=True)
class TorchSaveSerializer:
    """One ``torch.save`` stream that ``torch.load`` and Lightning's ``ckpt_path`` read directly.

    By default the zip records carry no CRC-32 of their own (``torch.save`` spends 0.3-0.5 CPU seconds per GB on it,
    and every object already has the library's checksum); ``unzip -t`` then reports a CRC mismatch. ``zip_crc32=True``
    keeps ``torch.save``'s behaviour, as does a torch without the switch or a replaced ``torch.save``.

    Attributes:
        name: The object's name inside the generation.
        zip_crc32: Compute the zip records' own CRC-32 as ``torch.save`` does (default ``False``).
    """

    name: str = "checkpoint.ckpt"
    zip_crc32: bool = False

    def write(self, state: Any, writer: GenerationWriter) -> None:
        """Stream ``torch.save(state)`` into the object ``name``."""
        with writer.open(self.name) as stream:
            # A replaced ``torch.save`` (a user's wrapper, a test's mock counting saves) sees every save, as it
            # would with ModelCheckpoint: then it is called as it is.
            patched = torch.save is not torch.serialization.save
            if self.zip_crc32 or patched or not _save_without_zip_crc(state, stream):
                torch.save(state, stream)


def _save_without_zip_crc(state: Any, stream: Any) -> bool:
    """``torch.save(state, stream)`` with a zip writer that skips its CRC-32; ``False`` when torch offers none.

    The process-wide ``torch.serialization.set_crc32_options`` is never touched: it would change the user's own
    ``torch.save`` calls on other threads.
    """
    serialization = torch.serialization
    save = getattr(serialization, "_save", None)
    alignment = getattr(serialization, "_get_storage_alignment", None)
    writer_type = getattr(torch._C, "PyTorchFileWriter", None)
    if save is None or alignment is None or writer_type is None:
        return False
    try:
        zip_writer = writer_type(stream, False, _storage_alignment(state, stream, alignment()))
    except TypeError:  # another signature: no per-writer CRC switch in this torch
        return False
    try:
        save(state, zip_writer, serialization.pickle, serialization.DEFAULT_PROTOCOL, False)
    finally:
        # As torch.save's own writer context does, even when the save failed: a writer left unfinished would write
        # its end record from its C++ destructor, whose error (the stream failed) terminates the process.
        zip_writer.write_end_of_file()
    return True


def _storage_alignment(state: Any, stream: Any, default: int) -> int:
    """Where the zip puts each storage's bytes: at the stream's preferred alignment (a direct-I/O file then writes
    the staged storages from their own page-aligned buffers, no copy) when the padding costs at most 1% of the
    bytes, else torch's default."""
    preferred = getattr(stream, "preferred_alignment", 1)
    if preferred <= default:
        return default
    sizes: dict[int, int] = {}
    todo, seen = [state], 0
    while todo and seen < 1_000_000:  # a bound on pathological states; what was seen decides
        item = todo.pop()
        seen += 1
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            todo.extend(item)
    return preferred if preferred * len(sizes) * 100 <= sum(sizes.values()) else default


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Engine settings.

    Attributes:
        max_outstanding: Saves that may be in flight at once (staging or uploading). Default 1.
        admission: What a request does when ``max_outstanding`` saves are in flight: ``wait``, ``skip``,
            ``coalesce`` or ``abort``.
        host_memory_budget: Most host bytes staging buffers may retain: bytes (``"4GiB"`` is kept as its bytes),
            ``"auto"`` (half the available memory at start) or ``None`` (unbounded).
        reserved_host_bytes: Host bytes other consumers need (prefetch, optimizer offload, other processes);
            subtracted from the budget.
        keep_last: Committed generations to keep (older ones are removed after each commit); ``None`` keeps all.
        guard: Check deferred tensors and refuse torn snapshots: ``True``/``"full"`` (the default, exact: version
            counters and a fingerprint of every deferred byte, read at the cut and on the staged copy), ``"sample"``
            (opt-in: version counters and 64 sampled bytes per storage, see ``miss_probability``),
            ``False``/``"off"``. See ``docs/concepts.md`` for exactly which writes each mode catches.
        on_error: ``raise`` a failed save on the caller thread at the next call, or ``warn`` and keep going.
        retries: Extra attempts for a failed upload (transient storage errors); ENOSPC is not retried.
        retry_backoff_s: First backoff; doubles per attempt.
        drain_timeout_s: Bound of the drain at interpreter exit.
        event_log: Path or URL of a JSONL event log; ``None`` keeps events in memory.
        serializer: How the staged state is written; default :class:`TorchSaveSerializer`.
        upload_nice: Nice value of the upload thread (0-19, Linux): higher lets training threads go first.
        huge_pages: Opt-in (Linux): back each deferred host storage with transparent huge pages after its first
            save, so the exact guard's write protection at each cut walks 512 times fewer page-table entries
            (:mod:`lightning_async_ckpt.core.huge_pages`; about 2 CPU seconds per GB once, in the background).
    """

    max_outstanding: int = 1
    admission: AdmissionPolicy = "wait"
    host_memory_budget: int | str | None = "auto"
    reserved_host_bytes: int = 0
    keep_last: int | None = None
    guard: bool | str = True
    on_error: Literal["raise", "warn"] = "raise"
    retries: int = 2
    retry_backoff_s: float = 0.5
    drain_timeout_s: float = 120.0
    event_log: str | None = None
    serializer: Serializer | None = None
    upload_nice: int = 0
    huge_pages: bool = False

    def __post_init__(self) -> None:
        validate_admission(self.admission, self.max_outstanding)
        budget = resolve_budget(self.host_memory_budget)  # validates the budget; with the reserve below
        if isinstance(self.host_memory_budget, str) and self.host_memory_budget != "auto":
            object.__setattr__(self, "host_memory_budget", budget)  # "4GiB" (YAML) kept as its bytes
        check_number("reserved_host_bytes", self.reserved_host_bytes)
        if self.host_memory_budget not in (None, "auto"):
            resolve_budget(self.host_memory_budget, self.reserved_host_bytes)
        check_number("keep_last", self.keep_last, 1, optional=True, hint=" (None keeps all)")
        if self.on_error not in ("raise", "warn"):
            raise ConfigError(f"on_error must be 'raise' or 'warn', got {self.on_error!r}")
        check_number("retries", self.retries)
        resolve_guard_mode(self.guard)  # names the accepted values
        for name in ("retry_backoff_s", "drain_timeout_s"):
            check_number(name, getattr(self, name), integer=False, finite=True)
        if self.event_log is not None and (not isinstance(self.event_log, str) or not self.event_log.strip()):
            raise ConfigError(f"event_log must be None or a non-empty path or URL string, got {self.event_log!r}")
        if (
            isinstance(self.upload_nice, bool)
            or not isinstance(self.upload_nice, int)
            or not 0 <= self.upload_nice <= 19
        ):
            raise ConfigError(
                f"upload_nice must be an int from 0 (normal) to 19 (lowest priority), got {self.upload_nice!r}"
            )
        if not isinstance(self.huge_pages, bool):
            raise ConfigError(f"huge_pages must be True or False, got {self.huge_pages!r}")
        if self.serializer is not None and not callable(getattr(self.serializer, "write", None)):
            raise ConfigError("serializer must have a write(state, writer) method")
