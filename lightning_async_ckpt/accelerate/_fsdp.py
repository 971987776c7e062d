"""Accelerate with FSDP2: the library's ``save_state`` as one DCP generation, every process writing its own shards.

The state is ``{"pytorch_model_fsdp_{i}": {"model": ...}, "optimizer_{i}": {"optimizer": ...}}`` taken with the
``StateDictOptions`` accelerate uses; each key also gets its own ``.metadata`` subfolder
(:mod:`~lightning_async_ckpt.sharded.dcp_views`) for accelerate's ``load_fsdp_model``/``load_fsdp_optimizer``. The
small files are serialized at the cut and written by the coordinator under accelerate's names. The hook path stays
accelerate's synchronous save here: accelerate writes FSDP state before its pre-hooks run.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch

from lightning_async_ckpt.accelerate._layout import _indexed, _layout_state
from lightning_async_ckpt.accelerate._prehooks import remove_when_done, run_save_pre_hooks
from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.errors import ConfigError
from lightning_async_ckpt.sharded.checkpointer import ShardedCheckpointer
from lightning_async_ckpt.sharded.persister import DCP_VIEWS
from lightning_async_ckpt.storage.store import CheckpointStore

if TYPE_CHECKING:
    from lightning_async_ckpt.core.engine import SaveHandle

__all__ = ["FSDP2_HOOK_PATH", "check_fsdp", "is_fsdp", "is_fsdp2", "save_fsdp2"]

#: Logged once when ``accelerator.save_state`` runs under FSDP2 with a checkpointer attached.
FSDP2_HOOK_PATH = (
    "accelerator.save_state under FSDP2 stays synchronous: accelerate writes the model and optimizer shards with a "
    "blocking dcp.save before any save_state pre-hook runs, and this folder gets no manifest. For asynchronous, "
    "fenced, per-rank checkpoints call lightning_async_ckpt.accelerate.save_state(accelerator, uri) instead"
)


def is_fsdp(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs FSDP (either version)."""
    return getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type)) == "FSDP"


def is_fsdp2(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return is_fsdp(accelerator) and getattr(plugin, "fsdp_version", 1) == 2


def check_fsdp(accelerator: Any) -> None:
    """Refuse FSDP setups the library cannot save asynchronously, naming what works instead.

    Raises:
        ConfigError: FSDP1, or FSDP2 with a full (gathered) state dict.
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not is_fsdp2(accelerator):
        raise ConfigError(
            "lightning_async_ckpt supports FSDP through FullyShardedDataParallelPlugin(fsdp_version=2) only (every "
            "process stages and writes its own shards); this run uses FSDP1. Switch to fsdp_version=2, or use "
            "accelerator.save_state without attach()"
        )
    kind = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
    if kind != "SHARDED_STATE_DICT":
        raise ConfigError(
            f"FSDP2 with state_dict_type={kind}: lightning_async_ckpt writes sharded checkpoints (every process its "
            "own shards, resharded on load); pass FullyShardedDataParallelPlugin(fsdp_version=2, "
            "state_dict_type='SHARDED_STATE_DICT'), or use accelerator.save_state without attach()"
        )


def _options(accelerator: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    config = accelerator.state.fsdp_plugin.state_dict_config  # as accelerate's _prepare_sd_options
    return StateDictOptions(
        full_state_dict=False,
        cpu_offload=getattr(config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(config, "rank0_only", False),
    )


def fsdp_state(accelerator: Any) -> dict[str, Any]:
    """What accelerate's FSDP2 ``save_state`` gives DCP, as one state: local shards, aliasing live state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(accelerator)
    models = accelerator._models
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"pytorch_model_fsdp_{i}"] = {"model": get_model_state_dict(model, options=options)}
    for i, opt in enumerate(accelerator._optimizers):
        inner = getattr(opt, "optimizer", opt)  # accelerate pairs optimizer i with model i
        state[f"optimizer_{i}"] = {"optimizer": get_optimizer_state_dict(models[i], inner, options=options)}
    return state


def small_files(accelerator: Any, rngs: list[dict[str, Any]], hook_files: dict[str, Any]) -> dict[str, bytes]:
    """Every other file accelerate's FSDP2 ``save_state`` writes, serialized now (at the cut)."""
    skip = {_indexed("optimizer", i, ".bin") for i in range(len(accelerator._optimizers))}
    out: dict[str, bytes] = {}
    for name, (kind, payload) in {**hook_files, **_layout_state(accelerator, rngs, weights=[])}.items():
        if name in skip:
            continue  # written with DCP (optimizer_{i}/)
        if "/" in name or name.startswith("__") or name == ".metadata":
            raise ConfigError(
                f"a save_state pre-hook wrote {name!r}: under FSDP2 the generation's other files are plain file names "
                "beside DCP's own; write it directly into output_dir under another name"
            )
        if kind == "torch":
            buf = io.BytesIO()
            torch.save(payload, buf)
            out[name] = buf.getvalue()
        elif kind == "file":
            with open(payload, "rb") as f:
                out[name] = f.read()
        else:
            out[name] = payload
    return out


def save_fsdp2(ckpt: Any, step: int, rngs: list[dict[str, Any]], *, automatic: bool, final: bool) -> SaveHandle:
    """The library's ``save_state`` under FSDP2 (collective): one DCP generation ``step`` of ``ckpt.uri``.

    Every process builds its cut; the processes agree that every one did before any enters the sharded engine
    (whose ``dcp.save`` is collective), so a failure at the cut is raised on every process and nothing is written.

    Args:
        ckpt: The :class:`~lightning_async_ckpt.accelerate.AccelerateCheckpointer`.
        step: The generation's step.
        rngs: Every process's RNG states (gathered at the cut), by process index.
        automatic: Asked for accelerate's automatically named folder (not offered with FSDP2).
        final: The checkpoint that ends training: everything copied at the cut.

    Raises:
        ConfigError: The checkpointer has no ``uri``, or ``automatic`` naming was asked for.
    """
    acc = ckpt.accelerator
    if ckpt.uri is None or automatic:
        raise ConfigError(
            "save_state under FSDP2 writes a sharded generation of a store: attach(accelerator, uri=...) and save "
            "there (accelerate's automatically named checkpoint_N folders are not written asynchronously with FSDP2)"
        )
    error: BaseException | None = None
    state: dict[str, Any] = {}
    objects: dict[str, bytes] | None = None
    hook_folder: str | None = None
    try:
        files, hook_folder = run_save_pre_hooks(acc, [], ckpt._is_own, keep=ckpt._main)
        state = fsdp_state(acc)
        objects = small_files(acc, rngs, files) if ckpt._main else None
    except Exception as exc:  # noqa: BLE001 - raised on every process by the collective below
        error = exc
    handle = None
    try:
        ckpt._collective(error, doing=f"save_state(step={step})")
        engine = sharded_engine(ckpt)
        handle = engine.save(
            step,
            state,
            objects=objects,
            defer=ckpt.defer,
            final=final,
            cut={"accelerator_step": acc.step, "num_processes": acc.num_processes},
            extra={DCP_VIEWS: list(state)},
        )
    finally:
        remove_when_done(hook_folder, handle)
    ckpt.handles.append(handle)
    return handle


def sharded_engine(ckpt: Any) -> ShardedCheckpointer:
    """The checkpointer's sharded engine, created at its first FSDP2 save (a collective: its gloo group)."""
    if ckpt._sharded is None:
        opts = ckpt.options
        store = CheckpointStore(ckpt.uri, ckpt.storage_options, run_id=ckpt.run_id)
        engine = ShardedCheckpointer(
            store,
            keep_last=opts.keep_last,
            guard=opts.guard,
            host_memory_budget=opts.host_memory_budget,
            options=opts,
            timeout_s=getattr(ckpt._collective_group, "timeout_s", None) or 300.0,
        )
        ckpt._sharded = engine
    acc = ckpt.accelerator  # models and optimizers prepared since the last save are classified too
    fences = {Fence.OPTIMIZER_STEP} if ckpt.defer else set()
    ckpt._sharded.declare_fences(fences, modules=acc._models, optimizers=acc._optimizers)
    return ckpt._sharded
