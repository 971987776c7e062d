"""Exception hierarchy.

Every error is an ``Exception`` (never a bare ``BaseException``), so ``except Exception`` in user code sees it.
Messages name the parameter or object at fault and how to fix it.
"""

from __future__ import annotations

import math
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
    "check_number",
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


def check_number(
    name: str,
    value: Any,
    minimum: float = 0,
    *,
    integer: bool = True,
    above: bool = False,
    optional: bool = False,
    finite: bool = False,
    hint: str = "",
) -> None:
    """Check that ``value`` is an int (a number when ``integer`` is False; never a bool) at least ``minimum``.

    Args:
        name: the parameter, as the user spells it.
        value: what was given.
        minimum: the smallest value allowed (excluded when ``above``); NaN is always refused.
        integer: an int is required; else any int or float.
        above: ``value`` must be greater than ``minimum``.
        optional: ``None`` is allowed too.
        finite: infinity is refused.
        hint: what the value means, added to the message (e.g. ``" (0 disables it)"``).

    Raises:
        ConfigError: naming ``name``, what is allowed and what was given.
    """
    if optional and value is None:
        return
    kind = int if integer else int | float
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not (value > minimum if above else value >= minimum)
        or (finite and not math.isfinite(value))
    ):
        noun = "an int" if integer else "a finite number" if finite else "a number"
        bound = f"{'>' if above else '>='} {minimum}"
        raise ConfigError(f"{name} must be {'None or ' if optional else ''}{noun} {bound}{hint}, got {value!r}")
