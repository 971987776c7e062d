"""DDP with every rank writing a slice: Lightning's checkpoint in torch DCP's format, and loading it back under DDP.

With ``ddp_layout="sliced"`` every rank hands its replicated state to the sharded engine and DCP writes each item
once. Only parameters that require grad and their optimizer state are proven identical across ranks; everything
else (buffers, frozen parameters, extra state) is written from rank 0 only (:func:`replicated_only`).
:func:`install_dcp_loader` makes DDP's checkpoint IO read such a folder into the single-writer checkpoint's dict.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.lightning.naming import model_key_for
from lightning_async_ckpt.storage.dcp_metadata import check_dcp_folder, load_dcp_folder

__all__ = [
    "DDP_LAYOUTS",
    "check_ddp_layout",
    "guard_strategy_dcp_loads",
    "install_dcp_loader",
    "is_dcp_folder",
    "is_ddp",
    "load_lightning_dcp",
    "replicated_only",
    "writes_sharded",
]

_log = logging.getLogger("lightning_async_ckpt")

#: Values of ``AsyncCheckpointCallback(ddp_layout=...)``.
DDP_LAYOUTS = ("single", "sliced")
_META = "meta.pt"
_DCP_METADATA = ".metadata"
_INSTALLED = "_lightning_async_ckpt_dcp_loader"
_GUARDED = "_lightning_async_ckpt_dcp_guard"


def check_ddp_layout(ddp_layout: Any) -> str:
    """Validate ``AsyncCheckpointCallback(ddp_layout=...)``.

    Raises:
        ConfigError: Not one of :data:`DDP_LAYOUTS`.
    """
    if ddp_layout not in DDP_LAYOUTS:
        raise ConfigError(
            f"ddp_layout must be 'single' (rank 0 writes one checkpoint file) or 'sliced' (every rank writes a "
            f"slice, torch DCP format), got {ddp_layout!r}"
        )
    return ddp_layout


def is_ddp(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``DDPStrategy`` (or a subclass): replicated model and optimizer state."""
    return "DDPStrategy" in {cls.__name__ for cls in type(strategy).__mro__}


def replicated_only(state_dict: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """The entries of ``module``'s ``state_dict`` that DDP keeps identical on every rank: parameters that require grad.

    Ranks other than 0 hand in only these; buffers, frozen parameters, extra state and anything else come from rank
    0 (what ``ModelCheckpoint`` writes), never from the rank DCP's deduplication would pick.
    """
    synced = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {key: value for key, value in state_dict.items() if key in synced}


def is_dcp_folder(path: Any) -> bool:
    """Whether ``path`` is a local folder holding a Lightning DCP checkpoint (DCP's ``.metadata`` and ``meta.pt``)."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    return (
        text is not None
        and os.path.isdir(text)
        and os.path.isfile(os.path.join(text, _DCP_METADATA))
        and os.path.isfile(os.path.join(text, _META))
    )


def load_lightning_dcp(
    folder: str, weights_only: bool | None = None, *, trust_pickled_objects: bool = False
) -> dict[str, Any]:
    """Read a Lightning DCP checkpoint folder, without a process group, into Lightning's single-file checkpoint dict.

    Never runs code from the folder by default: DCP's ``.metadata`` is read through an allow-listed unpickler (DCP's
    metadata classes only) and its byte items with ``torch.load(weights_only=True)``
    (:mod:`~lightning_async_ckpt.storage.dcp_metadata`); DCP's own reader would unpickle both without limits.

    Args:
        folder: A local generation folder (``__<rank>_0.distcp``, ``.metadata``, ``meta.pt``).
        weights_only: Passed to ``torch.load`` of ``meta.pt`` (as Lightning does).
        trust_pickled_objects: Unpickle DCP's files as DCP does (runs any code they name): only when every writer of
            the folder is trusted.

    Returns:
        ``meta.pt``'s dict plus ``state_dict`` and ``optimizer_states`` (a list, optimizer ``i`` from
        ``optimizer_<i>``), equal to what ``ModelCheckpoint`` writes under DDP.

    Raises:
        UntrustedPickleError: A DCP file needs more than the restricted unpicklers allow (nothing of it was run); the
            message names ``trust_pickled_objects=True``.
    """
    state = load_dcp_folder(folder, trust=trust_pickled_objects)
    checkpoint = torch.load(os.path.join(folder, _META), weights_only=weights_only)
    checkpoint["state_dict"] = state.pop("state_dict")
    count = sum(1 for key in state if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [_int_param_ids(state.pop(f"optimizer_{i}")) for i in range(count)]
    return checkpoint


def _int_param_ids(osd: dict[str, Any]) -> dict[str, Any]:
    # A plain optimizer's state is keyed by the integer ids listed in param_groups; DCP flattened them to strings
    # (and lists each rank's items together). Restored to the ids, in param_groups order, as Optimizer.state_dict.
    params = [p for group in osd.get("param_groups", []) for p in group.get("params", [])]
    ids = {str(p): p for p in params}
    if "state" in osd:
        state = {ids.get(k, k) if isinstance(k, str) else k: v for k, v in osd["state"].items()}
        ordered = {p: state.pop(p) for p in params if p in state}
        osd["state"] = {**ordered, **state}
    return osd


def guard_strategy_dcp_loads(strategy: Any) -> None:
    """Check a DCP folder before a sharded strategy's own loader (FSDP, ``ModelParallelStrategy``) unpickles it.

    The folder is read first through the allow-listed unpicklers
    (:func:`~lightning_async_ckpt.storage.dcp_metadata.check_dcp_folder`) unless Lightning passes
    ``weights_only=False`` (the caller's explicit trust). Idempotent; paths that are not local DCP folders pass.
    """
    if getattr(strategy, _GUARDED, False):
        return
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        path = os.fspath(checkpoint_path) if isinstance(checkpoint_path, str | os.PathLike) else None
        if weights_only is not False and path is not None and os.path.isfile(os.path.join(path, _DCP_METADATA)):
            check_dcp_folder(path)
        return original(checkpoint_path, *args, **kwargs)

    strategy.load_checkpoint = load_checkpoint
    setattr(strategy, _GUARDED, True)


def install_dcp_loader(strategy: Any) -> None:
    """Let a file-based strategy (DDP, single device) load Lightning DCP folders through its checkpoint IO.

    Every other path goes to the checkpoint IO's own loader unchanged. Idempotent. DCP's files are read without
    running code (:func:`load_lightning_dcp`) unless Lightning passes ``weights_only=False``
    (``trainer.fit(..., weights_only=False)``: the caller's explicit trust, as for Lightning's own loader).
    """
    checkpoint_io = strategy.checkpoint_io
    if getattr(checkpoint_io, _INSTALLED, False):
        return
    original = checkpoint_io.load_checkpoint

    def load_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_dcp_folder(path):
            return original(path, *args, **kwargs)
        weights_only = kwargs.get("weights_only", args[1] if len(args) > 1 else None)
        _log.info("loading the DCP checkpoint folder %s without a process group", path)
        return load_lightning_dcp(
            os.fspath(path), weights_only=weights_only, trust_pickled_objects=weights_only is False
        )

    checkpoint_io.load_checkpoint = load_checkpoint
    setattr(checkpoint_io, _INSTALLED, True)


def writes_sharded(callback: Any, trainer: Any) -> bool:
    """Whether this fit writes DCP generations (a sharded strategy, or DDP with ``ddp_layout="sliced"``)."""
    if model_key_for(trainer.strategy) is not None:
        return True
    sliced = getattr(callback, "ddp_layout", "single") == "sliced"
    return sliced and is_ddp(trainer.strategy) and trainer.world_size > 1
