"""Accelerate integration: asynchronous ``save_state`` in accelerate's own file layout.

Two paths, both driven by an :class:`AccelerateCheckpointer` that :func:`attach` installs on an ``Accelerator``:

* **Hook path**: ``accelerator.save_state(output_dir)`` as before. A save-state pre-hook takes the model weights out
  of accelerate's hands (it pops them from ``weights``) and stages them in the background, into
  ``model.safetensors`` / ``model_{i}.safetensors``; accelerate still writes optimizers, schedulers, sampler and
  dataloader state, ``scaler.pt``, ``random_states_{rank}.pkl`` and ``custom_checkpoint_{i}.pkl`` synchronously.
  ``output_dir`` is one generation: ``manifest.json`` is written in it last, once both parts are complete.
* **Fully asynchronous path**: :func:`save_state` (or :meth:`AccelerateCheckpointer.save_state`) captures everything
  accelerate would save at the cut and writes the same layout as one generation ``<uri>/step-XXXXXXXX/`` of a
  :class:`~lightning_async_ckpt.storage.store.CheckpointStore` (local or ``s3://``), or, called without ``uri`` under
  ``ProjectConfiguration(automatic_checkpoint_naming=True)``, as accelerate's own ``checkpoint_N`` folder (its
  iteration and ``total_limit``). accelerate's save-state pre-hooks run as ``accelerator.save_state`` runs them, and
  what they write is committed with the generation. A load first waits for this process's saves still in flight
  there (:mod:`lightning_async_ckpt.storage.inflight`). :func:`load_state` restores the newest
  committed generation with ``accelerator.load_state`` (also the newest committed ``checkpoint_N`` of accelerate's
  automatic naming); it never lets accelerate unpickle a custom object that ``torch.load(weights_only=True)``
  refuses unless called with ``trust_pickled_objects=True``.

Fences: an optimizer step pre-hook on each prepared optimizer's inner ``torch.optim.Optimizer`` sits right before the
update; parameters (and, in the second path, optimizer state) are staged behind it when
:func:`~lightning_async_ckpt.core.capture.prove_deferral` holds. Buffers, RNG, counters and Python state are copied at
the cut.

When is the hook path's folder complete? The pre-hook runs *before* accelerate writes its files, and accelerate has
no post-hook. Without patching accelerate, the first call into this library after ``save_state`` returned (the next
optimizer step, the next ``save_state``, ``load_state`` or :meth:`AccelerateCheckpointer.close`) is where the
training thread knows accelerate's part is done; in multi-process runs that call is a collective, so every rank's
files are done. Only then does the background thread check that accelerate's expected files exist and are complete
``torch.save`` archives, fsync them, and write the manifest.
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
