"""Export of a committed generation's model weights to safetensors, as its own committed generation.

Every source object is read once and checked against its manifest, loaded without arbitrary unpickling, cut into
shards of at most ``max_shard_size`` and written into a fresh attempt of the target, manifest last. A failure aborts
the target attempt; an export already committed at that step is returned as it is (written once, never reopened).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_async_ckpt.errors import ConfigError, GenerationExistsError
from lightning_async_ckpt.storage.dcp_metadata import load_dcp_folder
from lightning_async_ckpt.storage.io import read_verified
from lightning_async_ckpt.storage.manifest import Manifest
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.storage.verification import object_path

__all__ = [
    "EXPORT_FORMAT",
    "EXPORTED_FROM_KEY",
    "INDEX_NAME",
    "SINGLE_NAME",
    "export_location",
    "export_safetensors",
    "model_tensors",
    "parse_dtype",
]

_log = logging.getLogger("lightning_async_ckpt")
#: ``Manifest.extra["format"]`` of an export generation.
EXPORT_FORMAT = "safetensors"
#: ``Manifest.extra`` key naming the generation an export was made from.
EXPORTED_FROM_KEY = "exported_from"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MODEL_KEYS = ("state_dict", "model", "module")  # Lightning, plain loops / ShardedCheckpointer, wrapped modules
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def export_location(uri: str) -> str:
    """Where exports of the store at ``uri`` go by default: its ``exports/safetensors`` folder (a store of its own,
    which the source store's listing, retention and resume never read)."""
    return f"{uri.rstrip('/')}/exports/{EXPORT_FORMAT}"


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a floating-point ``torch.dtype`` (names: ``float32``, ``float16``, ``bfloat16``, ``float64``)."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(f"dtype must be None or a floating-point dtype ({', '.join(_DTYPES)}), got {dtype!r}")


def model_tensors(state: Any, model_key: str | None = None, strip_prefix: str | None = None) -> dict[str, Any]:
    """The model's tensors in a loaded checkpoint: ``state[model_key]`` (default: the first of ``state_dict``,
    ``model``, ``module`` that holds tensors, else ``state`` itself when it is a flat dict of tensors).

    Raises:
        ConfigError: No model weights were found (the message names ``model_key`` and the keys there are).
    """
    keys = (model_key,) if model_key is not None else _MODEL_KEYS
    found = next((state[k] for k in keys if isinstance(state, dict) and isinstance(state.get(k), dict)), None)
    flat = isinstance(state, dict) and bool(state) and all(isinstance(v, torch.Tensor) for v in state.values())
    if found is None and model_key is None and flat:
        found = state
    tensors = {} if found is None else dict(_flatten(found))
    if not tensors:
        there = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"no model weights under model_key={model_key!r} in the checkpoint (its top-level keys: {there}); pass "
            "model_key= naming the entry that holds the model's state dict"
        )
    if strip_prefix:
        tensors = {k.removeprefix(strip_prefix): v for k, v in tensors.items()}
    return tensors


def _flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            yield prefix + str(key), value
        elif isinstance(value, dict):  # DCP's consolidation gives nested dicts back
            yield from _flatten(value, f"{prefix}{key}.")


def export_safetensors(
    source: CheckpointStore | str,
    step: int,
    target: CheckpointStore | str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int = 5 << 30,
    model_key: str | None = None,
    strip_prefix: str | None = None,
    storage_options: dict[str, Any] | None = None,
    scratch_dir: str | None = None,
    trust_pickled_objects: bool = False,
) -> Manifest:
    """Write the model weights of committed generation ``step`` of ``source`` as safetensors, committed in ``target``.

    Args:
        source: The store (or its URL) holding the committed generation (single-stream or DCP-sharded).
        step: The generation's step; the export is generation ``step`` of ``target``.
        target: Where the export is committed (default: :func:`export_location` of ``source``).
        dtype: Cast floating-point tensors to this dtype (``None``: as saved).
        max_shard_size: Bytes per file; above it the weights are split into ``model-0000i-of-0000n.safetensors``
            with a ``model.safetensors.index.json`` (Hugging Face's layout).
        model_key: The checkpoint entry holding the model's state dict (default: see :func:`model_tensors`).
        strip_prefix: Removed from the start of every tensor name (``"model."`` for an HF model kept as
            ``self.model`` in a LightningModule, so ``from_pretrained`` finds its names).
        storage_options: fsspec options for ``source``/``target`` given as URLs.
        scratch_dir: Where the verified copy of the source is read from (default: the system's temp folder).
        trust_pickled_objects: Load the checkpoint with ``torch.load(weights_only=False)`` (and DCP's own
            unpickling): runs code the file names, so only when every writer of the store is trusted.

    Returns:
        The export's manifest (``extra["format"] == "safetensors"``).

    Raises:
        ConfigError: Bad ``dtype``, ``max_shard_size`` or ``model_key``.
        ManifestError: ``step`` is not committed in ``source``, or an object failed its size or checksum.
    """
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    cast = parse_dtype(dtype)
    options = storage_options or {}
    src = source if isinstance(source, CheckpointStore) else CheckpointStore(source, options, check_writable=False)
    manifest = src.manifest(step)
    dst = target if isinstance(target, CheckpointStore) else None
    if dst is None:
        dst = CheckpointStore(target or export_location(src.uri), options, run_id=manifest.run_id)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning_async_ckpt-export-", dir=scratch_dir) as scratch:
        state = _load(src, manifest, scratch, trust=trust_pickled_objects)
        tensors = model_tensors(state, model_key, strip_prefix)
        if cast is not None:
            tensors = {k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()}
        read_s = time.monotonic() - started
        try:
            writer = dst.begin(step)
        except GenerationExistsError:
            _log.info("step %d is exported in %s already: kept as it is", step, dst.uri)
            return dst.manifest(step)
        try:
            names = _write_shards(writer, tensors, max_shard_size)
            extra = {
                "format": EXPORT_FORMAT,
                EXPORTED_FROM_KEY: {"uri": src.uri, "step": step, "run_id": manifest.run_id},
                "dtype": None if cast is None else str(cast).removeprefix("torch."),
                "files": names,
            }
            timings = {"read_s": read_s, "export_s": time.monotonic() - started}
            return writer.commit(cut=manifest.cut, timings=timings, extra=extra)
        except BaseException:
            writer.abort()
            raise


def _load(store: CheckpointStore, manifest: Manifest, scratch: str, *, trust: bool) -> Any:
    """Copy every object of ``manifest`` into ``scratch`` (verified as it passes) and load the checkpoint."""
    root = store.root.rstrip("/")
    for obj in manifest.objects:
        path = object_path(store.location, manifest.step, obj)
        local = os.path.join(scratch, *posixpath.relpath(path, root).split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as out:
            read_verified(store.fs, path, obj, into=out)
    generation = os.path.join(scratch, *posixpath.relpath(store.generation_path(manifest.step), root).split("/"))

    def local_of(obj: Any) -> str:
        return os.path.join(generation, *obj.key.split("/"))

    if manifest.dcp_folder is not None:
        folder = os.path.join(generation, *manifest.dcp_folder.split("/")) if manifest.dcp_folder else generation
        return load_dcp_folder(folder, trust=trust)
    weights = [o for o in manifest.objects if o.name.startswith("model") and o.name.endswith(".safetensors")]
    if weights:  # accelerate's layout: the model's weights are safetensors files already
        from safetensors.torch import load_file

        return {k: v for obj in weights for k, v in load_file(local_of(obj)).items()}
    streams = [o for o in manifest.objects if o.name.endswith((".ckpt", ".pt", ".pth"))] or list(manifest.objects)
    if len(streams) != 1:
        raise ConfigError(
            f"step {manifest.step} has {len(streams)} candidate checkpoint files ({[o.name for o in streams]}); "
            "export reads one torch.save stream, accelerate's model*.safetensors or a DCP generation"
        )
    return torch.load(local_of(streams[0]), map_location="cpu", weights_only=not trust, mmap=True)


def _write_shards(writer: Any, tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[str]:
    from safetensors.torch import save as to_bytes

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    count = len(shards)
    names = [SINGLE_NAME] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for name, shard in zip(names, shards, strict=True):
        # Own contiguous CPU copies: tied weights share storage, which safetensors refuses; one shard at a time.
        data = to_bytes({k: v.detach().to("cpu").contiguous().clone() for k, v in shard.items()}, {"format": "pt"})
        writer.write_bytes(name, data)
    if count > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        writer.write_bytes(INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode())
        names.append(INDEX_NAME)
    return names
