"""The deferral proof: how late each category of state may be staged after the cut, and why.

:func:`prove_deferral` checks the rules under which parameters and optimizer state are first written by the next
optimizer update, and demotes them to an earlier fence when a rule does not hold.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer

__all__ = [
    "FENCE_ORDER",
    "FINAL_PROOF",
    "OFFLOAD_OPTIMIZER_MARKERS",
    "Category",
    "DeferralProof",
    "Fence",
    "forward_writers",
    "is_own_hook",
    "proof_inputs",
    "prove_deferral",
    "storage_key",
]


class Category(str, Enum):
    """State categories, each with one mutation rule (see the design brief)."""

    PARAMETER = "parameter"
    OPTIMIZER_STATE = "optimizer_state"
    OFFLOADED_OPTIMIZER_STATE = "offloaded_optimizer_state"
    BUFFER = "buffer"
    COUNTER = "counter"
    RNG = "rng"
    SCHEDULER = "scheduler"
    PYTHON = "python"
    UNKNOWN = "unknown"


class Fence(str, Enum):
    """Where the staging wait of a category sits; ordered from earliest to latest."""

    CUT = "cut"
    BATCH_START = "batch_start"
    OPTIMIZER_STEP = "optimizer_step"


FENCE_ORDER = {Fence.CUT: 0, Fence.BATCH_START: 1, Fence.OPTIMIZER_STEP: 2}
# Known optimizers that keep state away from the parameters and may update it during backward.
OFFLOAD_OPTIMIZER_MARKERS = ("offload", "cpuadam", "zero")
# Standard modules whose forward writes their own parameters in place, and the attribute that turns it on.
_FORWARD_WRITERS: tuple[tuple[type[torch.nn.Module], str], ...] = (
    (torch.nn.Embedding, "max_norm"),
    (torch.nn.EmbeddingBag, "max_norm"),
)


def storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    """Identity of a tensor's storage: tensors that share it (views, tied weights) share the key."""
    return (t.device, t.untyped_storage().data_ptr())


@dataclass(frozen=True)
class DeferralProof:
    """The rules under which a category may be staged after the cut, and whether they hold.

    Attributes:
        fences: Latest fence each category may use (categories not listed are copied at the cut).
        rules: Human-readable statements of what was checked, one per rule.
        failures: Rules that did not hold (their categories were demoted to an earlier fence).
        pinned: Storages copied at the cut whatever their category's fence, by :func:`storage_key`, with the
            reason (parameters a module writes in its own forward).
    """

    fences: dict[Category, Fence] = field(default_factory=dict)
    rules: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()
    pinned: dict[tuple[torch.device, int], str] = field(default_factory=dict)


#: The plan's rule for the checkpoint that ends training (``save(..., final=True)``): everything copied at the cut.
FINAL_PROOF = DeferralProof(
    fences={}, failures=("the checkpoint that ends training is copied at the cut: no training follows to overlap",)
)


def forward_writers(modules: Sequence[torch.nn.Module]) -> dict[tuple[torch.device, int], str]:
    """Parameters that a standard module writes in place during its forward, with the reason.

    ``nn.Embedding`` and ``nn.EmbeddingBag`` with ``max_norm`` renormalize the rows they look up in place, in
    training and in evaluation (so a validation forward writes them too). Unknown modules that do the same are
    caught by the runtime guard instead.
    """
    pinned: dict[tuple[torch.device, int], str] = {}
    for module in modules:
        for name, sub in module.named_modules():
            for cls, attr in _FORWARD_WRITERS:
                if isinstance(sub, cls) and getattr(sub, attr, None) is not None:
                    reason = (
                        f"{type(sub).__name__}({attr}=...) at {name or type(module).__name__} writes its weight "
                        "in every forward: copied at the cut"
                    )
                    for p in sub.parameters(recurse=False):
                        pinned[storage_key(p)] = reason
    return pinned


def prove_deferral(
    modules: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    *,
    automatic_optimization: bool = True,
    has_optimizer_step_fence: bool = True,
    has_batch_start_fence: bool = True,
    extra_failures: Iterable[str] = (),
    ignore_hooks: Callable[[Any], bool] | None = None,
) -> DeferralProof:
    """Decide how late parameters, optimizer state and buffers may be staged.

    Parameters and optimizer state may wait until the next optimizer update only under the rules of
    ``docs/concepts.md`` ("The proof"), else until the batch-start fence (or the cut); buffers at most until
    the batch-start fence. Parameters written by their own module's forward (:func:`forward_writers`) are pinned to
    the cut.

    Args:
        modules: The modules whose parameters and buffers are saved.
        optimizers: The optimizers whose state is saved (Lightning's wrappers are unwrapped).
        automatic_optimization: Whether the framework alone drives ``optimizer.step``.
        has_optimizer_step_fence: Whether the caller will call ``wait(Fence.OPTIMIZER_STEP)`` before updates.
        has_batch_start_fence: Whether the caller will call ``wait(Fence.BATCH_START)`` before the next forward.
        extra_failures: Rules the caller already knows to fail (e.g. "module overrides on_after_backward").
        ignore_hooks: Predicate for other hooks known not to write parameters (this library's own fence hooks
            are always ignored).

    Returns:
        The proof, with the latest allowed fence per category. The same proof object is returned again while
        nothing it depends on changed (:func:`proof_inputs`); ``ignore_hooks`` must answer the same for the same
        hook.
    """
    flags = (automatic_optimization, has_optimizer_step_fence, has_batch_start_fence, tuple(extra_failures))
    key = proof_inputs(modules, optimizers, (*flags, ignore_hooks))
    with _proofs_lock:
        cached = _proofs.get(key)
    if cached is None:
        cached = _prove(modules, optimizers, *flags, ignore_hooks)
        with _proofs_lock:
            if len(_proofs) >= _PROOFS_KEPT:
                _proofs.pop(next(iter(_proofs)))
            _proofs[key] = cached
    return cached


# The last few proofs by what they were proven from (a plain loop and a Lightning fit each use one at a time).
_proofs: dict[tuple, DeferralProof] = {}
_proofs_lock = threading.Lock()
_PROOFS_KEPT = 8


def _hook_ids(hooks: Any) -> tuple:
    return tuple((k, id(v)) for k, v in hooks.items()) if hooks else ()


def proof_inputs(modules: Sequence[torch.nn.Module], optimizers: Sequence[Any], extra: tuple = ()) -> tuple:
    """Everything :func:`prove_deferral` reads, cheaply: identities, types, hook table entries, parameter ownership.

    Two equal answers mean the same proof: the module tree (each submodule's type, children and ``max_norm``), each
    parameter's identity, ``requires_grad``, storage and gradient hooks, every module and optimizer hook table (and
    the global ones) entry by entry, each optimizer's type, ``step`` (its class's and its own) and the parameters of
    its groups. A hook added or removed, a parameter group added, a parameter frozen or replaced changes it.
    """
    parts: list[Any] = [extra]
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)
        groups = getattr(opt, "param_groups", None) or ()
        parts.append(
            (
                id(opt),
                type(opt),
                id(getattr(type(opt), "step", None)),
                id(getattr(opt, "__dict__", {}).get("step")),
                _hook_ids(getattr(opt, "_optimizer_step_pre_hooks", None)),
                tuple(len(g["params"]) for g in groups),
                tuple(id(p) for g in groups for p in g["params"]),
            )
        )
    parts.append(_hook_ids(getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)))
    for module in modules:
        parts.append(id(module))
        for sub in module.modules():
            parts.append(
                (
                    id(sub),
                    type(sub),
                    tuple(sub._modules),
                    sub.__dict__.get("max_norm"),
                    _hook_ids(sub._forward_pre_hooks),
                    _hook_ids(sub._forward_hooks),
                    _hook_ids(sub._backward_hooks),
                    _hook_ids(getattr(sub, "_backward_pre_hooks", None)),
                )
            )
            for name, p in sub._parameters.items():
                if p is None:
                    parts.append((name, None))
                    continue
                parts.append(
                    (
                        name,
                        id(p),
                        p.requires_grad,
                        p.device,
                        _storage_key(p),
                        _hook_ids(getattr(p, "_post_accumulate_grad_hooks", None)),
                        _hook_ids(getattr(p, "_backward_hooks", None)),
                    )
                )
    for attr in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks"):
        parts.append(_hook_ids(getattr(torch.nn.modules.module, attr, None)))
    parts.append(_hook_ids(getattr(torch.nn.modules.module, "_global_backward_pre_hooks", None)))
    return tuple(parts)


def _storage_key(p: torch.Tensor) -> object:
    """Where ``p``'s storage lives; a fresh object (never equal: the proof is rebuilt) when it has none to read, as
    FSDP2's sharded parameters between steps (a DTensor's invalid wrapper storage)."""
    try:
        return p.untyped_storage().data_ptr()
    except RuntimeError:
        return object()


def _prove(
    modules: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    automatic_optimization: bool,
    has_optimizer_step_fence: bool,
    has_batch_start_fence: bool,
    extra_failures: tuple[str, ...],
    ignore_hooks: Callable[[Any], bool] | None,
) -> DeferralProof:
    rules: list[str] = []
    failures: list[str] = list(extra_failures)
    opts = [getattr(opt, "optimizer", opt) for opt in optimizers]  # LightningOptimizer wraps .optimizer
    rules.append("optimization is automatic (only the framework calls optimizer.step)")
    if not automatic_optimization:
        failures.append("manual optimization: user code may write parameters before the step")
    rules.append("every optimizer is a torch.optim.Optimizer and none offloads its state")
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            failures.append(f"optimizer {type(opt).__name__} is not a torch.optim.Optimizer")
        elif any(marker in type(opt).__name__.lower() for marker in OFFLOAD_OPTIMIZER_MARKERS):
            failures.append(f"optimizer {type(opt).__name__} offloads its state")
    rules.append("every optimizer's step is torch.optim's own and no step pre-hook runs before the fence")
    failures.extend(_optimizer_failures(opts, ignore_hooks))
    rules.append("every parameter that requires grad is owned by an optimizer")
    owned = {
        id(p) for opt in opts if isinstance(opt, torch.optim.Optimizer) for g in opt.param_groups for p in g["params"]
    }
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in owned:
                failures.append(f"parameter {name} requires grad but no optimizer owns it")
                break
    rules.append("no forward/backward, gradient or post-accumulate-grad hooks or parametrizations can write parameters")
    failures.extend(_hook_failures(modules, ignore_hooks))
    if not has_optimizer_step_fence:
        failures.append("no fence before the optimizer update")
    rules.append("no standard module writes its parameters in forward (those are pinned to the cut)")
    pinned = forward_writers(modules)

    late = Fence.OPTIMIZER_STEP if not failures else (Fence.BATCH_START if has_batch_start_fence else Fence.CUT)
    buffer_fence = Fence.BATCH_START if has_batch_start_fence else Fence.CUT
    fences = {Category.PARAMETER: late, Category.OPTIMIZER_STATE: late, Category.BUFFER: buffer_fence}
    return DeferralProof(fences=fences, rules=tuple(rules), failures=tuple(failures), pinned=pinned)


#: Attribute marking this library's own fence hooks (``core/hooks.py`` sets it): they only wait.
OWN_HOOK_MARK = "_lightning_async_ckpt"


def is_own_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of this library's fence hooks (the deferral proof always ignores those)."""
    return bool(getattr(hook, OWN_HOOK_MARK, False))


def _ignored(hook: Any, ignore_hooks: Callable[[Any], bool] | None) -> bool:
    return is_own_hook(hook) or bool(ignore_hooks and ignore_hooks(hook))


def _torch_step(step: Any) -> bool:
    func = inspect.unwrap(getattr(step, "__func__", step))
    return getattr(func, "__module__", "").startswith("torch.optim.")


def _optimizer_failures(opts: Sequence[Any], ignore_hooks: Callable[[Any], bool] | None) -> list[str]:
    """Code that ``optimizer.step(closure)`` runs before the closure (hence before the fence), per optimizer."""
    failures: list[str] = []
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        name = type(opt).__name__
        owner = next((k for k in type(opt).__mro__ if "step" in k.__dict__), None)
        if owner is None or owner is torch.optim.Optimizer or not _torch_step(owner.__dict__["step"]):
            failures.append(f"optimizer {name} overrides step (unknown code may write parameters before the closure)")
        elif "step" in vars(opt) and not _torch_step(vars(opt)["step"]):
            failures.append(f"optimizer {name} has its step replaced on the instance")
        hooks = [h for h in getattr(opt, "_optimizer_step_pre_hooks", {}).values() if not _ignored(h, ignore_hooks)]
        if hooks:
            failures.append(f"optimizer {name} has {len(hooks)} step pre-hook(s) (they run before the closure)")
    global_hooks = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
    count = sum(1 for h in global_hooks.values() if not _ignored(h, ignore_hooks))
    if count:
        failures.append(f"{count} global optimizer step pre-hook(s) are registered (they run before the closure)")
    return failures


def _hook_failures(modules: Sequence[torch.nn.Module], ignore_hooks: Callable[[Any], bool] | None) -> list[str]:
    failures: list[str] = []
    for module in modules:
        for name, sub in module.named_modules():
            hooks = [
                *sub._forward_pre_hooks.values(),
                *sub._forward_hooks.values(),
                *sub._backward_hooks.values(),
                *getattr(sub, "_backward_pre_hooks", {}).values(),
            ]
            hooks = [h for h in hooks if not _ignored(h, ignore_hooks)]
            if hooks:
                failures.append(f"module {name or type(sub).__name__} has {len(hooks)} forward/backward hook(s)")
                break
            if torch.nn.utils.parametrize.is_parametrized(sub):
                failures.append(f"module {name or type(sub).__name__} is parametrized")
                break
        for name, p in module.named_parameters():
            # Optimizer-in-backward: a post-accumulate-grad hook can step the optimizer during backward.
            if getattr(p, "_post_accumulate_grad_hooks", None):
                failures.append(f"parameter {name} has a post-accumulate-grad hook (it may update during backward)")
                break
            # Tensor.register_hook on a parameter: runs in backward, before the fence, and may write the weight.
            if [h for h in (getattr(p, "_backward_hooks", None) or {}).values() if not _ignored(h, ignore_hooks)]:
                failures.append(f"parameter {name} has a gradient hook (it runs in backward and may write it)")
                break
    global_hooks = [
        getattr(torch.nn.modules.module, attr, {})
        for attr in (
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    ]
    count = sum(1 for hooks in global_hooks for h in hooks.values() if not _ignored(h, ignore_hooks))
    if count:
        failures.append(f"{count} global module hook(s) are registered")
    return failures
