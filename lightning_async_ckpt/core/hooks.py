"""Fences for plain PyTorch loops: an optimizer step pre-hook and a forward pre-hook that wait for staging."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_async_ckpt.core.capture import Fence
from lightning_async_ckpt.core.proof import OWN_HOOK_MARK, is_own_hook
from lightning_async_ckpt.errors import ConfigError

__all__ = ["FenceHooks", "is_own_hook"]


def _fence_hook(wait: Callable[[Fence], Any], fence: Fence) -> Callable[..., None]:
    def hook(*_: Any) -> None:  # returns None: a forward pre-hook's return value would replace the input
        wait(fence)

    setattr(hook, OWN_HOOK_MARK, True)
    return hook


class FenceHooks:
    """The fences a caller passes: installed torch hooks (:meth:`attach`) or declared ones (:meth:`declare`).

    Args:
        wait: Called with the fence being passed (the engine's ``wait``).
    """

    def __init__(self, wait: Callable[[Fence], Any]) -> None:
        self._wait = wait
        self._handles: list[Any] = []
        self.fences: set[Fence] = set()

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
    ) -> None:
        """Install an optimizer step pre-hook per optimizer and a forward pre-hook on ``model``."""
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}")
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(_fence_hook(self._wait, Fence.OPTIMIZER_STEP)))
        self._handles.append(model.register_forward_pre_hook(_fence_hook(self._wait, Fence.BATCH_START)))
        self.fences |= {Fence.OPTIMIZER_STEP, Fence.BATCH_START}

    def declare(self, fences: Iterable[Fence]) -> None:
        """Record the fences an integration calls itself (it installs its own hooks)."""
        self.fences = set(fences)

    def remove(self) -> None:
        """Remove the installed hooks and forget every fence."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.fences.clear()
