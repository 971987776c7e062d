"""RNG states at the cut, in a form ``torch.load(weights_only=True)`` accepts, and their restore on resume."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

__all__ = ["collect_portable_rng", "restore_rng"]


def collect_portable_rng() -> dict[str, Any]:
    """Every RNG state Lightning tracks, with numpy's key array as a tensor (loadable with ``weights_only``)."""
    out = dict(_collect_rng_states())
    if "numpy" in out:
        kind, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    return out


def restore_rng(states: dict[str, Any]) -> None:
    """Set the RNG states captured by :func:`collect_portable_rng`."""
    states = dict(states)
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        states["numpy"] = (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    _set_rng_states(states)
