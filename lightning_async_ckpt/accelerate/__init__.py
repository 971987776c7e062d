"""Accelerate integration: asynchronous ``save_state`` in accelerate's own file layout (``docs/accelerate.md``).

:func:`attach` installs an :class:`AccelerateCheckpointer` on an ``Accelerator``. The hook path keeps
``accelerator.save_state(output_dir)`` and stages only the weights in the background; the manifest is written once
the first call into this library after ``save_state`` (a collective with several processes) shows accelerate's own
files are done. The fully asynchronous path, :func:`save_state`, captures everything at the cut and writes one
generation of a store or accelerate's ``checkpoint_N`` folder. :func:`load_state` restores the newest committed
generation and never unpickles what ``torch.load(weights_only=True)`` refuses unless ``trust_pickled_objects=True``.
"""

from __future__ import annotations

from lightning_async_ckpt.accelerate._attach import attach, save_state
from lightning_async_ckpt.accelerate._checkpointer import AccelerateCheckpointer
from lightning_async_ckpt.accelerate._layout import INCOMPLETE_MARKER
from lightning_async_ckpt.accelerate._load import load_state
from lightning_async_ckpt.accelerate._tiers import TieredAccelerateCheckpointer

__all__ = [
    "INCOMPLETE_MARKER",
    "AccelerateCheckpointer",
    "TieredAccelerateCheckpointer",
    "attach",
    "load_state",
    "save_state",
]
