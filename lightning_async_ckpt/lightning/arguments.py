"""Validation of ``AsyncCheckpointCallback``'s own arguments (the engine's options validate themselves)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_async_ckpt.errors import ConfigError, GenerationExistsError, check_number
from lightning_async_ckpt.lightning.naming import comparable_path, model_key_for
from lightning_async_ckpt.tiers.target import check_apart

__all__ = [
    "ModelCheckpointConfigError",
    "Selection",
    "check_arguments",
    "check_selection",
    "check_shared_dirpath",
    "check_strategy",
    "check_tiers",
    "committed_clash",
    "normalize_dirpath",
    "resolve_dirpath",
]


class ModelCheckpointConfigError(ConfigError, MisconfigurationException):
    """A bad value ``ModelCheckpoint`` refuses with a ``MisconfigurationException``: raised as both that exception
    (code catching it keeps working) and a :class:`~lightning_async_ckpt.errors.ConfigError`, with
    ``ModelCheckpoint``'s wording followed by the fix."""


def normalize_dirpath(dirpath: Any, name: str = "dirpath") -> str | None:
    """``dirpath`` as ``ModelCheckpoint`` keeps it: a ``str``; a local path with ``~`` expanded, made absolute and
    its links resolved (``os.path.realpath``); a URL (``s3://...``, ``file://...``) untouched; ``""`` stays ``""``
    (names relative to the working directory, resolved at setup by :func:`resolve_dirpath`).

    Raises:
        ConfigError: ``dirpath`` is neither ``None``, a ``str`` nor an ``os.PathLike``.
    """
    if dirpath is None:
        return None
    if not isinstance(dirpath, (str, os.PathLike)):
        raise ConfigError(
            f"{name} must be None, a path (str or os.PathLike such as pathlib.Path) or an fsspec URL string, "
            f"got {type(dirpath).__name__} {dirpath!r}"
        )
    path = os.fspath(dirpath)
    if not isinstance(path, str):  # a bytes path
        raise ConfigError(f"{name} must be a text path, not bytes: pass {os.fsdecode(path)!r}")
    if not path or "://" in path:
        return path
    return os.path.realpath(os.path.expanduser(path))


def resolve_dirpath(dirpath: str | None, default_root_dir: Any) -> str:
    """Where the callback writes: ``dirpath``, ``<default_root_dir>/checkpoints`` for ``None``, or the working
    directory for ``""`` (``ModelCheckpoint`` writes relative file names there)."""
    if dirpath is None:
        return f"{str(default_root_dir).rstrip('/')}/checkpoints"
    if dirpath == "":
        return os.path.realpath(os.getcwd())
    return dirpath


def check_arguments(
    *,
    dirpath: Any,
    every_n_train_steps: Any,
    every_n_epochs: Any,
    flags: dict[str, Any],
    storage_options: Any,
) -> None:
    """Raise :class:`ConfigError` naming the argument and what it accepts, before anything is created."""
    normalize_dirpath(dirpath)
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(
                f"{name} must be None or an int >= 0 (0 disables it, like ModelCheckpoint), got {value!r}"
            )
        if value is not None and value < 0:
            raise ModelCheckpointConfigError(
                f"Invalid value for {name}={value}. Must be >= 0 (0 disables it; None leaves it unset)"
            )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")


def check_strategy(strategy: Any) -> None:
    """Refuse strategies the callback cannot checkpoint correctly (see ``docs/sharded.md``).

    Sharded strategies are supported when they save DCP folders (every rank writes its shards):
    ``ModelParallelStrategy(save_distributed_checkpoint=True)`` and ``FSDPStrategy(state_dict_type="sharded")``.
    """
    name = type(strategy).__name__
    if "DeepSpeed" in name:
        raise ConfigError(
            f"AsyncCheckpointCallback does not support {name}: DeepSpeed writes its own checkpoint format; use "
            "ModelCheckpoint with DeepSpeed, or ModelParallelStrategy/FSDPStrategy with sharded checkpoints"
        )
    if ("FSDP" in name or "ModelParallel" in name) and model_key_for(strategy) is None:
        fix = "save_distributed_checkpoint=True" if "ModelParallel" in name else 'state_dict_type="sharded"'
        raise ConfigError(
            f"AsyncCheckpointCallback writes {name} checkpoints sharded (every rank writes its shards in torch DCP "
            f"format); this {name} is configured for full (rank 0) checkpoints: pass {fix}"
        )


@dataclass(frozen=True)
class Selection:
    """``ModelCheckpoint``'s selection arguments, validated, and what they mean for this store.

    Attributes:
        filename: The name template (``None``: ``ModelCheckpoint``'s ``"{epoch}-{step}"``).
        monitor: The metric ranked by ``save_top_k`` (``None``: no ranking).
        mode: ``"min"`` or ``"max"``.
        save_top_k: The value ``ModelCheckpoint`` reports (loggers read it; ``-1`` means every generation is kept,
            ``0`` that none is ranked: only ``save_last`` cuts, or none at all without it).
        top_k: With ``monitor``: how many committed generations to keep by score, ``-1`` all.
        save_last: ``None``/``False``/``True``/``"link"``.
        keep_last: The engine's count-based retention (``None``: none, or best-k retention of the callback).
        keep_newest: With ``monitor``: how many of the newest committed generations best-k retention keeps too.
    """

    filename: str | None
    monitor: str | None
    mode: str
    save_top_k: int
    top_k: int
    save_last: bool | str | None
    keep_last: int | None
    keep_newest: int


def check_selection(
    *,
    filename: Any,
    monitor: Any,
    mode: Any,
    save_top_k: Any,
    save_last: Any,
    keep_last: Any,
    train_time_interval: Any,
    save_on_train_epoch_end: Any,
    save_on_exception: Any,
) -> Selection:
    """Validate ``ModelCheckpoint``'s arguments and map them onto the committed-generation store.

    Raises:
        ConfigError: Naming the argument and what to pass instead.
    """
    if filename is not None and not isinstance(filename, str):
        # "" is ModelCheckpoint's default name, like None.
        raise ConfigError(f"filename must be None or a template string like '{{epoch}}-{{step}}', got {filename!r}")
    if monitor is not None and (not isinstance(monitor, str) or not monitor):
        raise ConfigError(f"monitor must be None or the name of a logged metric, got {monitor!r}")
    if mode not in ("min", "max"):
        raise ModelCheckpointConfigError(f"`mode` can be min, max but got {mode}: pass mode='min' or 'max'")
    if save_last not in (None, True, False, "link"):
        raise ConfigError(f"save_last must be None, True, False or 'link', got {save_last!r}")
    if save_top_k is not None and (isinstance(save_top_k, bool) or not isinstance(save_top_k, int)):
        raise ConfigError(f"save_top_k must be None or an int >= -1, got {save_top_k!r}")
    if save_top_k is not None and save_top_k < -1:
        raise ModelCheckpointConfigError(
            f"Invalid value for save_top_k={save_top_k}. Must be >= -1 (-1 keeps every checkpoint, 0 none)"
        )
    if train_time_interval is not None and (
        not isinstance(train_time_interval, timedelta) or train_time_interval.total_seconds() < 0
    ):
        raise ConfigError(
            f"train_time_interval must be None or a non-negative datetime.timedelta, got {train_time_interval!r}"
        )
    if save_on_train_epoch_end not in (None, True, False):
        raise ConfigError(f"save_on_train_epoch_end must be None, True or False, got {save_on_train_epoch_end!r}")
    if save_on_exception not in (True, False):
        raise ConfigError(f"save_on_exception must be True or False, got {save_on_exception!r}")
    if monitor is None:
        if save_top_k not in (None, -1, 0, 1):
            raise ModelCheckpointConfigError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration. No quantity "
                "for top_k to track: pass monitor=<metric name> to rank checkpoints by, or save_top_k=1 (keep the "
                "newest), -1 (keep all), or keep_last=N (keep the newest N)"
            )
        if save_top_k is not None and keep_last is not None:
            raise ConfigError(
                f"save_top_k={save_top_k} and keep_last={keep_last} both set how many generations to keep; "
                "without monitor pass only one of them"
            )
        # Nothing set keeps the newest generation, like ModelCheckpoint's save_top_k=1 without monitor.
        engine_keep = (
            (1 if keep_last is None else keep_last) if save_top_k is None else (None if save_top_k == -1 else 1)
        )
        reported = 0 if save_top_k == 0 else (-1 if engine_keep is None else engine_keep)
        return Selection(filename, None, mode, reported, 0, save_last, engine_keep, 1)
    top_k = 1 if save_top_k is None else save_top_k
    check_number("keep_last", keep_last, 1, optional=True)
    return Selection(filename, monitor, mode, top_k, top_k, save_last, None, keep_last or 1)


def check_shared_dirpath(callback: Any, trainer: Any) -> None:
    """Refuse a second ``AsyncCheckpointCallback`` writing to the same ``dirpath`` (found at setup, before training).

    ``ModelCheckpoint`` instances can share a folder because their file names differ; here a generation is the
    step's folder, so two callbacks would collide at the first step both save (possibly the last one of the fit).
    """

    def place(cb: Any) -> str:
        return comparable_path(resolve_dirpath(cb.dirpath, trainer.default_root_dir))

    mine = place(callback)
    for other in trainer.callbacks:
        if other is not callback and type(other) is type(callback) and place(other) == mine:
            raise ConfigError(
                f"two {type(callback).__name__}s write to dirpath {mine!r}: a generation is the folder of its step, "
                "so they would collide at the first step both save. Give each its own dirpath (e.g. "
                f"'{mine}/best' and '{mine}/periodic'); ModelCheckpoint instances can share one folder only because "
                "their file names differ"
            )


def check_tiers(
    *,
    dirpath: str | None,
    local_dirpath: Any,
    local_every_n_train_steps: Any,
    local_keep_last: Any,
    every_n_train_steps: Any,
    monitor: Any,
    replicas: Any = None,
) -> str | None:
    """Validate the local tier's arguments (``docs/tiers.md``) beside the normalized ``dirpath``; return
    ``local_dirpath`` normalized (or ``None``).

    Raises:
        ConfigError: Naming the argument and what it accepts.
    """
    named = (("local_every_n_train_steps", local_every_n_train_steps), ("local_keep_last", local_keep_last))
    for name, value in (*named, ("replicas", replicas)):
        check_number(name, value, 1, optional=True)
    local = normalize_dirpath(local_dirpath, "local_dirpath")
    if local is None and replicas is not None:
        raise ConfigError(
            f"replicas={replicas} copies the local tier to other nodes: pass local_dirpath too (a node-local folder "
            "such as /local_nvme/ckpt), or drop replicas"
        )
    if local is None:
        if local_every_n_train_steps is not None or local_keep_last is not None:
            raise ConfigError(
                "local_every_n_train_steps and local_keep_last configure the local tier: pass local_dirpath too "
                "(a node-local folder such as /local_nvme/ckpt or /dev/shm/ckpt)"
            )
        return None
    if not local:
        raise ConfigError("local_dirpath must name a folder (node-local NVMe or /dev/shm), got ''")
    if dirpath:  # None (the default root's folder) and "" (the cwd) are checked at setup
        check_apart(dirpath, local)
    if monitor is not None:
        raise ConfigError(
            f"monitor={monitor!r} (best-k) with local_dirpath is not supported: rank with a second "
            f"AsyncCheckpointCallback(dirpath=..., monitor={monitor!r}) without local_dirpath beside this one, or "
            "drop monitor (docs/configuration.md, local_dirpath)"
        )
    if local_every_n_train_steps is None and not every_n_train_steps:
        raise ConfigError(
            "local_dirpath needs a step cadence: pass local_every_n_train_steps=N (cuts to the local tier) and/or "
            "every_n_train_steps=M (the generations promoted to dirpath)"
        )
    return local


def committed_clash(step: int, committed_before: set[int], dirpath: Any) -> GenerationExistsError | None:
    """The error of a cut at a step ``dirpath`` held committed before this fit (``None``: no clash)."""
    if step not in committed_before:
        return None
    return GenerationExistsError(
        f"dirpath {dirpath!r} already holds a committed checkpoint for step {step} from an earlier run; "
        "committed checkpoints are never overwritten: use a new dirpath, or resume with "
        "trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))"
    )
