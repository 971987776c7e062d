"""Asynchronous, fenced, manifest-committed checkpoints for PyTorch Lightning, Accelerate and plain loops.

The public surface is listed in ``__all__``. Integrations that import Lightning or Accelerate are loaded on
first use, so importing the package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CheckpointStore": "lightning_async_ckpt.storage.store",
    "GenerationInfo": "lightning_async_ckpt.storage.store",
    "Manifest": "lightning_async_ckpt.storage.manifest",
    "AsyncCheckpointer": "lightning_async_ckpt.core.engine",
    "TieredCheckpointer": "lightning_async_ckpt.tiers.tiered",
    "CheckpointOptions": "lightning_async_ckpt.core.options",
    "TorchSaveSerializer": "lightning_async_ckpt.core.options",
    "SaveHandle": "lightning_async_ckpt.core.handle",
    "CapturePlan": "lightning_async_ckpt.core.capture",
    "DeferralProof": "lightning_async_ckpt.core.capture",
    "Fence": "lightning_async_ckpt.core.capture",
    "Committed": "lightning_async_ckpt.core.commit_hooks",
    "CommitCallbackError": "lightning_async_ckpt.core.commit_hooks",
    "SafetensorsExport": "lightning_async_ckpt.core.exporter",
    "Exporter": "lightning_async_ckpt.core.exporter",
    "ExportError": "lightning_async_ckpt.core.exporter",
    "export_safetensors": "lightning_async_ckpt.core.export",
    "AsyncCheckpointCallback": "lightning_async_ckpt.lightning",
    "latest_checkpoint": "lightning_async_ckpt.lightning",
    "CheckpointError": "lightning_async_ckpt.errors",
    "ConfigError": "lightning_async_ckpt.errors",
    "StorageError": "lightning_async_ckpt.errors",
    "ManifestError": "lightning_async_ckpt.errors",
    "GenerationExistsError": "lightning_async_ckpt.errors",
    "TornSnapshotError": "lightning_async_ckpt.errors",
    "AdmissionError": "lightning_async_ckpt.errors",
    "HostMemoryBudgetError": "lightning_async_ckpt.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_async_ckpt' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
