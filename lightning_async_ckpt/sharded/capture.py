"""Capture of a rank's local shards: the core capture plan, proof, guard and buffer pool over DTensor local tensors.

Every ``DTensor`` is replaced by its local tensor before the core plan is built (and rebuilt around its staged copy),
and modules and optimizers are shown to the plan through local views, so the plan is local: no collective. FSDP2's
forward hooks never write a sharded parameter's local data, so the proof ignores them (:func:`is_fsdp_hook`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_async_ckpt.core.capture import CapturePlan, Category, DeferralProof, Fence, prove_deferral
from lightning_async_ckpt.core.capturer import CutCapture, take_buffers
from lightning_async_ckpt.core.staging import BufferPool

__all__ = ["LocalCapture", "ShardedCapturer", "is_fsdp_hook", "local_tensor", "sharded_proof"]

Path = tuple[Any, ...]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s data on this rank (a DTensor's local shard, else ``t`` itself)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` is a forward hook of FSDP2's ``fully_shard`` (it never writes a sharded parameter's data)."""
    owner = type(getattr(hook, "__self__", None))
    return owner.__name__ == "FSDPState" and owner.__module__.startswith("torch.distributed.fsdp.")


def sharded_proof(
    modules: Sequence[torch.nn.Module], optimizers: Sequence[Any], fences: Iterable[Fence]
) -> DeferralProof:
    """The core deferral proof for FSDP2 (or plain) modules, given the fences the caller passes."""
    fences = set(fences)
    return prove_deferral(
        modules,
        optimizers,
        has_optimizer_step_fence=Fence.OPTIMIZER_STEP in fences,
        has_batch_start_fence=Fence.BATCH_START in fences,
        ignore_hooks=is_fsdp_hook,
    )


def _live_local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard as the plan sees a parameter: its storage, and its DTensor's ``requires_grad``.

    Shards that FSDP2 built from a meta-device module (accelerate's ``fsdp2_prepare_model``) have local tensors that
    do not require grad although their ``DTensor`` parameter does; the plan would take them for frozen parameters
    and copy them at the cut. An alias of the same storage carries the parameter's flag (storage identity decides).
    """
    t = local_tensor(p)
    if p is not t and p.requires_grad and not t.requires_grad:
        t = t.detach().requires_grad_(True)
    return t


class _ModuleView:
    """What the plan's classification reads of a module (``parameters``, ``buffers``), with local tensors."""

    def __init__(self, module: torch.nn.Module, local: dict[int, torch.Tensor]) -> None:
        self._params = [local.setdefault(id(p), _live_local(p)) for p in module.parameters()]
        self._buffers = [local_tensor(b) for b in module.buffers()]

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def buffers(self) -> list[torch.Tensor]:
        return self._buffers


class _OptimizerView:
    """What the plan's classification reads of an optimizer (``param_groups``, ``state``), with local tensors."""

    def __init__(self, optimizer: Any, local: dict[int, torch.Tensor]) -> None:
        self.param_groups = [
            {"params": [local.setdefault(id(p), _live_local(p)) for p in g["params"]]} for g in optimizer.param_groups
        ]
        self.state = {
            local.setdefault(id(p), _live_local(p)): (
                {k: local_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                if isinstance(s, dict)
                else s
            )
            for p, s in optimizer.state.items()
        }


def _optimizer_view(optimizer: Any, local: dict[int, torch.Tensor]) -> _OptimizerView:
    real = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps .optimizer
    # Named as the real class: the plan reads offloading optimizers from the class name.
    cls = type(type(real).__name__, (_OptimizerView,), {})
    return cls(real, local)


@dataclass
class _Spec:
    spec: Any
    shape: torch.Size
    stride: tuple[int, ...]


def _strip(obj: Any, path: Path, specs: dict[Path, _Spec]) -> Any:
    """``obj`` with every DTensor replaced by its local tensor; their specs recorded by path."""
    if isinstance(obj, DTensor):
        specs[path] = _Spec(obj._spec, obj.shape, obj.stride())
        return obj._local_tensor
    if isinstance(obj, dict):
        out = copy.copy(obj)
        out.clear()
        for k, v in obj.items():
            out[k] = _strip(v, (*path, k), specs)
        return out
    if type(obj) is list:
        return [_strip(v, (*path, i), specs) for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(_strip(v, (*path, i), specs) for i, v in enumerate(obj))
    return obj


def _dress(obj: Any, path: Path, specs: dict[Path, _Spec]) -> Any:
    """The inverse of :func:`_strip` over the staged tree: local copies become DTensors with the recorded specs."""
    spec = specs.get(path)
    if spec is not None:
        mesh = spec.spec.mesh
        if obj.device.type == mesh.device_type:
            return DTensor.from_local(
                obj, mesh, spec.spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
            )
        # A host copy of an accelerator DTensor keeps its sharding spec, as DCP's own CPU staging does
        # (from_local would move it back to the mesh's device).
        return DTensor(obj, spec.spec, requires_grad=False)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        out.clear()
        out.update((k, _dress(v, (*path, k), specs)) for k, v in obj.items())
        return out
    if type(obj) is list:
        return [_dress(v, (*path, i), specs) for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(_dress(v, (*path, i), specs) for i, v in enumerate(obj))
    return obj


@dataclass
class LocalCapture(CutCapture):
    """One rank's capture of one save: the core capture over local tensors, and the specs to rebuild DTensors.

    Attributes:
        plan: The core capture plan over local tensors (``plan.describe()`` prints it).
        job: The staging job: copy-at-cut storages are already copied; ``job.run()`` copies the rest.
        buffers: The pool's buffers (release them once the upload stopped reading them).
    """

    _specs: dict[Path, _Spec] = field(default_factory=dict)

    def staged_state(self) -> Any:
        """The state over the staged buffers, DTensors rebuilt with their specs (after ``job`` finished)."""
        return _dress(self.plan.materialize(self.buffers), (), self._specs)


class ShardedCapturer:
    """The engine's capturer for sharded state: DTensors through their local shards (see the module docstring).

    The modules and optimizers are bound once (``attach`` / ``declare_fences``) and used by every save that names
    none. The deferral proof is always the sharded one (FSDP2's own forward hooks are known not to write a
    sharded parameter's data); a caller's proof is not used.
    """

    def __init__(self) -> None:
        self._modules: list[torch.nn.Module] = []
        self._optimizers: list[Any] = []

    def bind(self, modules: Sequence[Any], optimizers: Sequence[Any]) -> None:
        """Remember the modules and optimizers whose state later saves hold."""
        self._modules, self._optimizers = list(modules), list(optimizers)

    def capture(
        self,
        state: Any,
        *,
        modules: Sequence[Any] | None,
        optimizers: Sequence[Any] | None,
        proof: DeferralProof | None,
        defer: bool,
        fences: Iterable[Fence],
        demoted: set[Category],
        pool: BufferPool,
        guard: bool | str,
    ) -> LocalCapture:
        """Classify ``state``'s local shards (DTensor leaves through their local tensors), copy what must be copied
        at the cut, and return the staging job; with the bound modules and optimizers unless the save names its own.
        The caller runs ``capture.job.run()`` (on a background thread) and waits at the fences.
        """
        modules = list(modules) if modules else self._modules
        optimizers = list(optimizers) if optimizers else self._optimizers
        specs: dict[Path, _Spec] = {}
        with torch.no_grad():
            local_state = _strip(state, (), specs)
            proof = sharded_proof(modules, optimizers, fences) if defer else None
            local: dict[int, torch.Tensor] = {}
            views = [_ModuleView(m, local) for m in modules]
            opt_views = [_optimizer_view(o, local) for o in optimizers]
            plan = CapturePlan.build(local_state, modules=views, optimizers=opt_views, proof=proof, demoted=demoted)
            taken = take_buffers(plan, pool, guard)
        return LocalCapture(plan=taken.plan, job=taken.job, buffers=taken.buffers, _specs=specs)
