"""Exception hierarchy.

Every error is an ``Exception`` (never a bare ``BaseException``), so ``except Exception`` in user code sees it.
Messages name the parameter or object at fault and how to fix it.
"""

from __future__ import annotations

import warnings
from typing import Any

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
    "renamed",
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


def renamed(new: str, new_value: Any, old: str, old_value: Any) -> Any:
    """The value of a renamed parameter: ``new_value``, or ``old_value`` (its former name) with a ``FutureWarning``.

    Raises:
        ConfigError: both names were given.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ConfigError(
            f"{old}={old_value!r} and {new}={new_value!r} are one setting ({old} is its former name); pass {new} only"
        )
    warnings.warn(
        f"{old} is now called {new} (the name AsyncCheckpointCallback uses); the old name will be removed",
        FutureWarning,
        stacklevel=3,
    )
    return old_value
