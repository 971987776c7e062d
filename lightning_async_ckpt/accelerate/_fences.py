"""Where the training thread waits for staging: an optimizer step pre-hook and a ``load_state_dict`` pre-hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_async_ckpt.core.capture import DeferralProof, prove_deferral
from lightning_async_ckpt.core.proof import OWN_HOOK_MARK

__all__ = ["deferral_proof", "install_fences"]


def deferral_proof(accelerator: Any, is_own: Callable[[Any], bool]) -> DeferralProof:
    """Whether parameters and optimizer state may be staged behind the optimizer-step fence.

    Args:
        accelerator: The ``Accelerator``.
        is_own: Whether a registered hook is one of the checkpointer's own fences (they only wait).
    """
    failures = []
    for model in accelerator._models:
        for name, sub in model.named_modules():
            if getattr(sub, "_hf_hook", None) is not None:
                failures.append(f"module {name or type(sub).__name__} has an accelerate hook that may move weights")
                break
    return prove_deferral(
        accelerator._models,
        accelerator._optimizers,
        has_optimizer_step_fence=True,
        has_batch_start_fence=False,
        extra_failures=failures,
        ignore_hooks=is_own,
    )


def install_fences(
    accelerator: Any,
    installed: dict[int, Any],
    on_step: Callable[..., None],
    on_load_weights: Callable[..., None],
) -> Any:
    """Install the fences on prepared optimizers and models that have none yet; return the first inner optimizer.

    Args:
        accelerator: The ``Accelerator``.
        installed: The hooks' handles by ``id`` of what they sit on (updated in place).
        on_step: The optimizer step pre-hook.
        on_load_weights: The module ``load_state_dict`` pre-hook.
    """
    first = None
    for i, opt in enumerate(accelerator._optimizers):
        inner = getattr(opt, "optimizer", opt)
        first = inner if i == 0 else first
        if id(inner) not in installed:
            installed[id(inner)] = inner.register_step_pre_hook(_marked(on_step))
    for model in accelerator._models:
        inner = accelerator.unwrap_model(model)  # a wrapper's load_state_dict reaches it before any weight
        if id(inner) not in installed:
            installed[id(inner)] = inner.register_load_state_dict_pre_hook(_marked(on_load_weights))
    return first


def _marked(fence: Callable[..., None]) -> Callable[..., None]:
    """``fence`` as a hook every deferral proof knows as the library's own (it only waits)."""

    def hook(*args: Any) -> None:
        fence(*args)

    setattr(hook, OWN_HOOK_MARK, True)
    return hook
