"""Exception hierarchy.

Every error is an ``Exception`` (never a bare ``BaseException``), so ``except Exception`` in user code sees it.
Messages name the parameter or object at fault and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "AdmissionError",
    "CheckpointError",
    "ConfigError",
    "GenerationExistsError",
    "HostMemoryBudgetError",
    "ManifestError",
    "ManifestVersionError",
    "StorageError",
    "StoreUnavailableError",
    "TornSnapshotError",
    "WriterUsageError",
]


class CheckpointError(RuntimeError):
    """Base class of the errors raised by this library at run time."""


class ConfigError(ValueError):
    """A constructor argument or option has a bad value; the message names it and the fix."""


class StorageError(CheckpointError):
    """Storage could not be read or written (the cause is chained)."""


class GenerationExistsError(StorageError):
    """A generation for this step is already committed; committed data is never overwritten."""


class ManifestError(StorageError):
    """A manifest is missing, malformed, hostile or from a newer format version."""


class ManifestVersionError(ManifestError):
    """A manifest was written by a newer format version than this library reads: upgrade to read it."""


class TornSnapshotError(CheckpointError):
    """The runtime guard saw a deferred tensor change before it was staged; the save was refused."""


class AdmissionError(CheckpointError):
    """A save was requested while the outstanding limit was reached and the admission policy is ``abort``."""


class HostMemoryBudgetError(CheckpointError):
    """The staging buffers would not fit in the configured host-memory budget."""


class WriterUsageError(CheckpointError, ValueError):
    """A :class:`~lightning_async_ckpt.storage.writer.GenerationWriter` was misused (an object opened twice,
    a commit with objects still open, a write after commit or abort): a bug in the caller, never retried."""


class StoreUnavailableError(StorageError):
    """The store's location cannot be listed (missing bucket, unreachable endpoint, no permission), so whether it
    holds checkpoints is unknown; never reported as "no checkpoint"."""
