"""Validation of ``AsyncCheckpointCallback``'s own arguments (the engine's options validate themselves)."""

from __future__ import annotations

from typing import Any

from lightning_async_ckpt.errors import ConfigError

__all__ = ["check_arguments", "check_strategy"]


def check_arguments(
    *,
    dirpath: Any,
    every_n_train_steps: Any,
    every_n_epochs: Any,
    flags: dict[str, Any],
    storage_options: Any,
) -> None:
    """Raise :class:`ConfigError` naming the argument and what it accepts, before anything is created."""
    if dirpath is not None and (not isinstance(dirpath, str) or not dirpath.strip()):
        raise ConfigError(f"dirpath must be a non-empty path or URL string, got {dirpath!r}")
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")
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
    from lightning_async_ckpt.lightning.sharded import model_key_for

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
