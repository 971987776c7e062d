"""The capture plan: which state is copied at the cut and which is staged later, behind which fence, and why.

A checkpoint's state is a nested structure of dicts, lists and tuples whose leaves are tensors and Python
objects. Building that structure is not staging: its tensors still alias live memory. The plan classifies each
tensor storage into a :class:`Category`, by identity with the parameters, buffers and optimizer state of the
modules and optimizers it is told about, and gives each category a capture mode:

* ``Fence.CUT``: copied synchronously when the checkpoint is requested (the default for everything unproven);
* ``Fence.BATCH_START``: staged in the background, waited for before the next forward;
* ``Fence.OPTIMIZER_STEP``: staged in the background, waited for right before the next optimizer update.

Deferral needs a proof (:mod:`lightning_async_ckpt.core.proof`), stated as a :class:`DeferralProof` whose
``rules`` are printed by :meth:`describe`; every row of the plan names the rule that decided its fence.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_async_ckpt.core.proof import (
    FENCE_ORDER,
    OFFLOAD_OPTIMIZER_MARKERS,
    Category,
    DeferralProof,
    Fence,
    prove_deferral,
    storage_key,
)

# Leaves that are immutable and hold no tensor: the plan keeps them as they are (Python's RNG state is a tuple of
# 625 ints; visiting each one cost milliseconds per cut).
_ATOMS = frozenset({int, float, bool, str, bytes, complex, type(None)})
# Categories whose first mutation after the cut is the optimizer update, when proven.
_OPTIMIZER_UPDATED = (Category.PARAMETER, Category.OPTIMIZER_STATE)

__all__ = ["CapturePlan", "Category", "DeferralProof", "Fence", "StorageSlot", "prove_deferral"]


@dataclass
class StorageSlot:
    """One distinct tensor storage of the state (tied weights and views share one slot).

    Attributes:
        index: Position in the plan.
        storage: The live untyped storage.
        nbytes: Its size in bytes.
        device: Its device.
        category: The most conservative category of the tensors that use it.
        fence: Where its staging wait sits.
        names: Paths in the state of the tensors that use it.
        tensors: The live tensors that use it (their version counters are the guard's first check).
        rule: Why the slot sits at its fence when that is not its category's rule (pinned or demoted).
    """

    index: int
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    category: Category
    fence: Fence
    names: list[str]
    tensors: list[torch.Tensor] = field(default_factory=list)
    rule: str | None = None


@dataclass
class _TensorRef:
    slot: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    parameter: bool
    requires_grad: bool


class CapturePlan:
    """Classification of a state's tensors into categories, fences and capture modes.

    Build it with :meth:`build`; :meth:`describe` prints it as a table. The plan keeps the state's skeleton:
    containers are rebuilt, non-tensor leaves deep-copied at the cut, and tensors are replaced by references to
    storage slots that the stager fills.

    Args:
        skeleton: The state with tensors replaced by references.
        slots: The distinct storages.
        proof: The deferral proof that set the fences.
    """

    def __init__(self, skeleton: Any, slots: list[StorageSlot], proof: DeferralProof) -> None:
        self.skeleton = skeleton
        self.slots = slots
        self.proof = proof

    @classmethod
    def build(
        cls,
        state: Any,
        *,
        modules: Sequence[torch.nn.Module] = (),
        optimizers: Sequence[Any] = (),
        proof: DeferralProof | None = None,
        demoted: Iterable[Category] = (),
    ) -> CapturePlan:
        """Classify ``state`` and deep-copy its non-tensor leaves (this is the synchronous part of the cut).

        Args:
            state: Nested dicts/lists/tuples of tensors and Python objects.
            modules: Modules whose parameters and buffers appear in ``state``.
            optimizers: Optimizers whose state appears in ``state``.
            proof: Allowed fences per category; ``None`` copies everything at the cut.
            demoted: Categories whose deferral failed the runtime guard before: copied at the cut.
        """
        proof = proof or DeferralProof()
        demoted = set(demoted)
        known = _classify_live(modules, optimizers)
        slots: list[StorageSlot] = []
        by_key: dict[tuple, int] = {}

        def fence_for(category: Category, key: tuple) -> tuple[Fence, str | None]:
            allowed = proof.fences.get(category, Fence.CUT)
            if allowed == Fence.CUT:
                return Fence.CUT, None
            if category in demoted:
                return Fence.CUT, "demoted after a guard failure: a deferred copy changed before it was staged"
            if key in proof.pinned:
                return Fence.CUT, proof.pinned[key]
            return allowed, None

        def visit(obj: Any, path: str) -> Any:
            if type(obj) in _ATOMS:
                return obj  # immutable: deepcopy would return it as is
            if isinstance(obj, torch.Tensor):
                return tensor_ref(obj, path)
            if isinstance(obj, dict):
                out = copy.copy(obj)  # keeps the dict subclass (OrderedDict, defaultdict) and its attributes
                out.clear()
                for k, v in obj.items():
                    out[k] = visit(v, f"{path}.{k}" if path else str(k))
                return out
            if isinstance(obj, list) and type(obj) is list:
                if all(type(v) in _ATOMS for v in obj):
                    return list(obj)
                return [visit(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            if isinstance(obj, tuple) and type(obj) is tuple:
                if all(type(v) in _ATOMS for v in obj):
                    return obj  # RNG states: hundreds of ints, immutable as a whole
                return tuple(visit(v, f"{path}[{i}]") for i, v in enumerate(obj))
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):
                return type(obj)(*(visit(v, f"{path}.{f}") for f, v in zip(obj._fields, obj, strict=True)))
            return copy.deepcopy(obj)

        def tensor_ref(t: torch.Tensor, path: str) -> Any:
            plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            if not plain or t.is_quantized or t.is_meta or t.untyped_storage().nbytes() == 0:
                return t.detach().clone()  # exotic or empty tensors: copied at the cut, not pooled
            storage = t.untyped_storage()
            key = storage_key(t)
            category = known.get(key) or _category_from_path(path, t)
            fence, rule = fence_for(category, key)
            slot_index = by_key.get(key)
            if slot_index is None:
                slot_index = len(slots)
                by_key[key] = slot_index
                slots.append(
                    StorageSlot(
                        index=slot_index,
                        storage=storage,
                        nbytes=storage.nbytes(),
                        device=t.device,
                        category=category,
                        fence=fence,
                        names=[path],
                        tensors=[t],
                        rule=rule,
                    )
                )
            else:
                slot = slots[slot_index]
                slot.names.append(path)
                slot.tensors.append(t)
                if FENCE_ORDER[fence] < FENCE_ORDER[slot.fence]:
                    slot.category, slot.fence, slot.rule = category, fence, rule
            return _TensorRef(
                slot=slot_index,
                dtype=t.dtype,
                offset=t.storage_offset(),
                size=tuple(t.size()),
                stride=tuple(t.stride()),
                parameter=isinstance(t, torch.nn.Parameter),
                requires_grad=t.requires_grad,
            )

        skeleton = visit(state, "")
        return cls(skeleton, slots, proof)

    @property
    def total_bytes(self) -> int:
        """Bytes of all distinct tensor storages."""
        return sum(s.nbytes for s in self.slots)

    def materialize(self, buffers: Sequence[torch.Tensor]) -> Any:
        """Rebuild the state with each tensor a view of its slot's staged buffer (sharing preserved)."""

        def rebuild(obj: Any) -> Any:
            if isinstance(obj, _TensorRef):
                buf = buffers[obj.slot]
                t = torch.empty(0, dtype=obj.dtype).set_(buf.untyped_storage(), obj.offset, obj.size, obj.stride)
                return torch.nn.Parameter(t, requires_grad=obj.requires_grad) if obj.parameter else t
            if isinstance(obj, dict):
                out = copy.copy(obj)
                out.clear()
                out.update((k, rebuild(v)) for k, v in obj.items())
                return out
            if type(obj) is list:
                return [rebuild(v) for v in obj]
            if type(obj) is tuple:
                return tuple(rebuild(v) for v in obj)
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):
                return type(obj)(*(rebuild(v) for v in obj))
            return obj

        return rebuild(self.skeleton)

    def rows(self) -> list[dict[str, Any]]:
        """One row per (category, fence): tensors, bytes, capture mode, fence and rule."""
        groups: dict[tuple[Category, Fence, str], dict[str, Any]] = {}
        for slot in self.slots:
            rule = slot.rule or self._rule(slot.category, slot.fence)
            row = groups.setdefault(
                (slot.category, slot.fence, rule),
                {"category": slot.category.value, "tensors": 0, "bytes": 0, "fence": slot.fence.value},
            )
            row["tensors"] += len(slot.names)
            row["bytes"] += slot.nbytes
        for (_, fence, rule), row in groups.items():
            row["capture"] = "copy at cut" if fence == Fence.CUT else "staged in background"
            row["rule"] = rule
        return sorted(groups.values(), key=lambda r: (FENCE_ORDER[Fence(r["fence"])], r["category"]))

    def _rule(self, category: Category, fence: Fence) -> str:
        if fence == Fence.OPTIMIZER_STEP:
            return "proven: " + "; ".join(self.proof.rules)
        if fence == Fence.BATCH_START:
            if category == Category.BUFFER:
                return "buffers mutate in the next forward"
            return "unproven (" + "; ".join(self.proof.failures or ("not deferred",)) + ")"
        if category in _OPTIMIZER_UPDATED and self.proof.failures and not self.proof.fences:
            return "unproven (" + "; ".join(self.proof.failures) + ")"
        return "default: unproven state is copied at the cut"

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary for the manifest."""
        return {"rows": self.rows(), "total_bytes": self.total_bytes, "failures": list(self.proof.failures)}

    def describe(self) -> str:
        """The plan as a text table: category, tensors, bytes, capture mode, fence, rule."""
        header = f"{'category':<26}{'tensors':>8}{'bytes':>14}  {'capture':<22}{'fence':<16}rule"
        lines = [header, "-" * len(header)]
        for r in self.rows():
            lines.append(
                f"{r['category']:<26}{r['tensors']:>8}{r['bytes']:>14,}  {r['capture']:<22}{r['fence']:<16}{r['rule']}"
            )
        lines.append(f"total {self.total_bytes:,} bytes in {len(self.slots)} storages")
        return "\n".join(lines)


def _classify_live(modules: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> dict[tuple, Category]:
    known: dict[tuple, Category] = {}
    key = storage_key

    owned = {
        id(p)
        for opt in optimizers
        for group in getattr(getattr(opt, "optimizer", opt), "param_groups", ())
        for p in group["params"]
    }
    for module in modules:
        for p in module.parameters():
            # Only the optimizer's parameters that require grad follow the optimizer's mutation rule; a frozen or
            # hand-updated one (an EMA teacher, a running statistic kept as a parameter) is unknown, copied at the cut.
            if id(p) in owned and p.requires_grad:
                known[key(p)] = Category.PARAMETER
        for b in module.buffers():
            known[key(b)] = Category.BUFFER
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)
        offload_cls = any(marker in type(opt).__name__.lower() for marker in OFFLOAD_OPTIMIZER_MARKERS)
        for p, state in getattr(opt, "state", {}).items():
            if not isinstance(state, dict):
                continue
            for v in state.values():
                if not isinstance(v, torch.Tensor) or v.untyped_storage().nbytes() == 0:
                    continue
                if v.dim() == 0:
                    # Adam's `step` and similar scalars: counters, tiny, copied at the cut.
                    known.setdefault(key(v), Category.COUNTER)
                elif offload_cls or (isinstance(p, torch.Tensor) and v.device != p.device):
                    known[key(v)] = Category.OFFLOADED_OPTIMIZER_STATE
                else:
                    known.setdefault(key(v), Category.OPTIMIZER_STATE)
    return known


def _category_from_path(path: str, t: torch.Tensor) -> Category:
    lowered = path.lower()
    if "rng" in lowered or "random" in lowered:
        return Category.RNG
    if "sched" in lowered:
        return Category.SCHEDULER
    if t.dim() == 0 or "loops" in lowered or "step" in lowered.rsplit(".", 1)[-1]:
        return Category.COUNTER
    return Category.UNKNOWN
