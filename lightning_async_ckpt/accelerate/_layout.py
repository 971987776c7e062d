"""Accelerate's file layout: the files ``accelerator.save_state`` writes, and how we write them.

The safetensors stream writer, the serializer of ``{file name: (kind, payload)}`` states, the RNG state and
file-layout helpers, and the check for unsupported distributed types. Nothing here imports accelerate at import time.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
import shutil
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_async_ckpt.errors import CheckpointError, ConfigError
from lightning_async_ckpt.storage.store import GenerationWriter

_log = logging.getLogger("lightning_async_ckpt")
_ATTR = "_lightning_async_ckpt"
INCOMPLETE_MARKER = ".lightning_async_ckpt-incomplete"
_UNSUPPORTED = ("MEGATRON_LM", "XLA")
# accelerate's synchronous files are torch.save zip archives: a truncated one has no central directory.
_ARCHIVE_RE = re.compile(
    r"^((optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|scaler\.pt)$"
)
_RNG_FILE_RE = re.compile(r"^random_states_(\d+)\.pkl$")
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
if hasattr(torch, "uint64"):
    _ST_DTYPES[torch.uint64] = "U64"


# -- accelerate's file layout ------------------------------------------------------------------------------
def _indexed(base: str, i: int, ext: str) -> str:
    return f"{base}{'' if i == 0 else f'_{i}'}{ext}"


def _write_safetensors(tensors: dict[str, torch.Tensor], stream: Any, metadata: dict[str, str]) -> None:
    """Stream ``tensors`` in safetensors format: 8-byte header length, JSON header, then raw little-endian bytes.

    Larger elements first, so every tensor's offset is aligned to its element size (the header is padded to 8).
    """
    if struct.pack("=H", 1) != struct.pack("<H", 1):
        raise CheckpointError("safetensors streaming needs a little-endian host")
    items = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"model state entry {name!r} ({type(t).__name__}) cannot be written as safetensors")
        items.append((name, t.detach()))
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in items:
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    stream.write(struct.pack("<Q", len(raw)))
    stream.write(raw)
    for _, t in items:
        if t.numel():
            stream.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class _LayoutSerializer:
    """Writes ``{object name: (kind, payload)}``: ``safetensors`` dicts, ``torch`` (``torch.save``), ``raw`` bytes or
    ``file`` (the bytes of a local file, by path)."""

    def write(self, state: Any, writer: GenerationWriter) -> None:
        for name, (kind, payload) in state.items():
            with writer.open(name) as stream:
                if kind == "safetensors":
                    _write_safetensors(payload, stream, {"format": "pt"})
                elif kind == "torch":
                    torch.save(payload, stream)
                elif kind == "file":  # a file a save-state pre-hook wrote (see _prehooks.py)
                    with open(payload, "rb") as f:
                        shutil.copyfileobj(f, stream, 8 << 20)
                else:
                    stream.write(payload)


def _clean(state_dict: dict) -> OrderedDict:
    # accelerate drops every key after the first that shares a storage before safetensors saving; so do we.
    from accelerate.utils.other import clean_state_dict_for_safetensors

    return clean_state_dict_for_safetensors(OrderedDict(state_dict))


def _rng_state(acc: Any) -> dict[str, Any]:
    """The dict accelerate writes to ``random_states_{rank}.pkl``."""
    import accelerate.utils as au

    def has(name: str) -> bool:
        return bool(getattr(au, name, lambda: False)())

    states: dict[str, Any] = {
        "step": acc.step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if has("is_xpu_available"):
        states["torch_xpu_manual_seed"] = torch.xpu.get_rng_state_all()
    if has("is_mlu_available"):
        states["torch_mlu_manual_seed"] = torch.mlu.get_rng_state_all()
    elif has("is_sdaa_available"):
        states["torch_sdaa_manual_seed"] = torch.sdaa.get_rng_state_all()
    elif has("is_musa_available"):
        states["torch_musa_manual_seed"] = torch.musa.get_rng_state_all()
    if has("is_hpu_available"):
        states["torch_hpu_manual_seed"] = torch.hpu.get_rng_state_all()
    if has("is_neuron_available"):
        states["torch_neuron_manual_seed"] = torch.neuron.get_rng_state_all()
    if has("is_cuda_available"):
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def _model_weights(acc: Any) -> list[dict]:
    """The state dicts ``accelerator.save_state`` saves (and hands its save-state pre-hooks), aliasing live state."""
    return [acc.get_state_dict(model, unwrap=False) for model in acc._models]


def _layout_state(
    acc: Any, rng_by_rank: list[dict[str, Any]], weights: list[dict] | None = None
) -> dict[str, tuple[str, Any]]:
    """Everything ``accelerator.save_state`` writes, as ``{file name: (kind, payload)}`` aliasing live state.

    ``weights`` are the models' state dicts left after the save-state pre-hooks ran (default: every model's).
    """
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    objects: dict[str, tuple[str, Any]] = {}
    for i, state_dict in enumerate(_model_weights(acc) if weights is None else weights):
        objects[_indexed("model", i, ".safetensors")] = ("safetensors", _clean(state_dict))
    for i, opt in enumerate(acc._optimizers):
        objects[_indexed("optimizer", i, ".bin")] = ("torch", opt.state_dict())
    for i, scheduler in enumerate(acc._schedulers):
        objects[_indexed("scheduler", i, ".bin")] = ("torch", scheduler.state_dict())
    for i, loader in enumerate(acc._dataloaders):
        if isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                # accelerate pickles the sampler object (with its data source); pickling it now is that same cost.
                buf = io.BytesIO()
                torch.save(sampler, buf)
                objects[_indexed("sampler", i, ".bin")] = ("raw", buf.getvalue())
        if getattr(loader, "use_stateful_dataloader", False):
            objects[_indexed("dl_state_dict", i, ".bin")] = ("torch", loader.state_dict())
    if acc.scaler is not None:
        objects["scaler.pt"] = ("torch", acc.scaler.state_dict())
    for rank, rng in enumerate(rng_by_rank):
        objects[f"random_states_{rank}.pkl"] = ("torch", rng)
    for i, obj in enumerate(acc._custom_objects):
        objects[f"custom_checkpoint_{i}.pkl"] = ("torch", obj.state_dict())
    return objects


def _expected_sync_files(acc: Any) -> set[str]:
    """Files accelerate's synchronous part of ``save_state`` must write on a writing process."""
    names = {_indexed("optimizer", i, ".bin") for i in range(len(acc._optimizers))}
    names |= {_indexed("scheduler", i, ".bin") for i in range(len(acc._schedulers))}
    names |= {f"custom_checkpoint_{i}.pkl" for i in range(len(acc._custom_objects))}
    names.add(f"random_states_{acc.process_index}.pkl")
    if acc.scaler is not None:
        names.add("scaler.pt")
    return names


def _check_supported(acc: Any) -> None:
    """Refuse distributed types whose models accelerate saves itself (FSDP is checked in ``_fsdp.py``)."""
    kind = getattr(acc.distributed_type, "name", str(acc.distributed_type))
    if kind == "DEEPSPEED":
        raise ConfigError(
            "lightning_async_ckpt cannot make DeepSpeed checkpoints asynchronous: DeepSpeed's engine saves the model "
            "and optimizer itself (save_checkpoint) before any save_state pre-hook runs. What works today: single "
            "device and DDP (attach + accelerator.save_state, or lightning_async_ckpt.accelerate.save_state), and "
            "FSDP2 with sharded state dicts (FullyShardedDataParallelPlugin(fsdp_version=2), then "
            "lightning_async_ckpt.accelerate.save_state(accelerator, uri): every process stages and writes its own "
            "shards). Use FSDP2 for sharded training with asynchronous checkpoints, or keep DeepSpeed and call "
            "accelerator.save_state without attach() (synchronous)"
        )
    if kind in _UNSUPPORTED:
        raise ConfigError(
            f"lightning_async_ckpt's Accelerate integration supports single-device, DDP and FSDP2 runs, not "
            f"distributed_type={kind}: accelerate saves those models itself before the save_state pre-hook runs "
            "(it receives no weights). Use accelerator.save_state without attach() there."
        )
