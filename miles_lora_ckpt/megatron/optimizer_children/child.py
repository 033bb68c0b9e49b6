"""What one optimizer child is: its class, its family, the optimizer it runs, the state keys it keeps.

Pure inspection of one rank's objects: no collectives, no mutation. megatron classes are recognised
by name along the MRO (never imported), so subclasses in forks are recognised too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Child",
    "DISTRIBUTED",
    "FLOAT16",
    "FP32",
    "MASTER_KEY",
    "PermutedLeaves",
    "SUPPORTED_CLASSES",
    "class_name",
    "has_state",
    "is_stub",
    "leaf_children",
    "master_replaceable",
    "never_stepped",
    "optimizer_kind",
    "resolve_state_keys",
]

MASTER_KEY = "param"  # the fp32 master weight, saved next to the state keys


def master_replaceable(master: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a load may give the fp32 `master` new data (`master.data = ...`) instead of writing
    into it: it lives on the CPU, where the verified bytes are, and shares no storage with `param`
    (its model parameter, or a view of the parameter's elements). A DistributedOptimizer over fp32
    model params holds views of the parameters as masters: those are written in place."""
    return master.device.type == "cpu" and master.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()


DISTRIBUTED = "DistributedOptimizer"
FLOAT16 = "Float16OptimizerWithFloat16Params"
FP32 = "FP32Optimizer"
LAYER_WISE = "LayerWiseDistributedOptimizer"
SUPPORTED_CLASSES = (DISTRIBUTED, FLOAT16, FP32)

# Inner (torch) optimizer class -> the optimizer a user names; a mismatch refuses a load.
_KINDS = {"Adam": "adam", "AdamW": "adam", "FusedAdam": "adam", "Lion": "lion", "SGD": "sgd", "FusedSGD": "sgd"}
# State keys per optimizer kind (megatron 0.19's `optimizer_state_keys`, extended to Muon), for
# children that have not stepped yet; a stepped child reports the keys it really holds.
_KEYS_BY_KIND = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
    "muon": ("momentum_buffer",),
    "sgd": ("momentum_buffer",),
}


@dataclass(frozen=True)
class Child:
    """One leaf of the optimizer chain on this rank.

    `index` is its position among the leaves, LayerWise per-slot children flattened in order (the
    numbering of Miles' `miles_slot_child_indices`); `layer_wise` says it sits under a
    LayerWiseDistributedOptimizer, which shards whole parameters over the DP ranks.
    """

    index: int
    optimizer: object
    layer_wise: bool = False

    @property
    def is_stub(self) -> bool:
        return is_stub(self.optimizer)

    @property
    def class_name(self) -> str:
        return class_name(self.optimizer)


@dataclass(frozen=True)
class PermutedLeaves:
    """A view of an optimizer chain whose leaf `i` is the real leaf `order[i]` (same optimizers,
    same `layer_wise`, renumbered): how a multi-LoRA slot generation saved from one slot's children
    is restored into another slot's (`savers.multi_lora.remap`). `leaf_children` reads it; nothing
    else does, and the view is never kept past one load."""

    optimizer: object
    order: tuple[int, ...]


def leaf_children(optimizer) -> list[Child]:
    """Every leaf child of `optimizer` (a ChainedOptimizer, a LayerWise chain, or one child), stubs included."""
    if isinstance(optimizer, PermutedLeaves):
        real = leaf_children(optimizer.optimizer)
        if sorted(optimizer.order) != list(range(len(real))):
            raise ValueError(f"a leaf permutation must reorder all {len(real)} children, got {list(optimizer.order)}")
        return [Child(i, real[o].optimizer, real[o].layer_wise) for i, o in enumerate(optimizer.order)]
    leaves: list[Child] = []

    def visit(node, layer_wise: bool) -> None:
        nested = getattr(node, "chained_optimizers", None)
        if nested is None:
            leaves.append(Child(len(leaves), node, layer_wise))
            return
        for sub in nested:
            visit(sub, layer_wise or _has_class(node, LAYER_WISE))

    visit(optimizer, False)
    return leaves


def is_stub(child) -> bool:
    """A child with no parameters anywhere: megatron builds it with `optimizer=None`."""
    return bool(getattr(child, "is_stub_optimizer", False)) or getattr(child, "optimizer", None) is None


def class_name(child) -> str:
    """The megatron class a child is (or derives from), else its own class name."""
    for cls in type(child).__mro__:
        if cls.__name__ in SUPPORTED_CLASSES:
            return cls.__name__
    return type(child).__name__


def _has_class(obj, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(obj).__mro__)


def optimizer_kind(child) -> str:
    """`adam`, `lion`, `muon`, `adaptive_muon`, `sgd`, or the inner optimizer's class name."""
    name = type(child.optimizer).__name__
    if name in _KINDS:
        return _KINDS[name]
    if name.endswith("Muon"):  # emerging-optimizers' Muon, megatron's TensorParallelMuon
        return "adaptive_muon" if "Adaptive" in name else "muon"
    return name


def has_state(child) -> bool:
    """Whether this rank's inner optimizer has allocated per-parameter state (it has stepped)."""
    return any(bool(s) for s in child.optimizer.state.values())


def never_stepped(child) -> bool:
    """Whether this rank's inner optimizer never stepped: no per-parameter state allocated, and
    every param group's step counter (where it keeps one) zero. A load into a child that never
    stepped on any rank has no optimizer state to undo (`megatron.undo`)."""
    return not has_state(child) and all(not group.get("step") for group in child.optimizer.param_groups)


def resolve_state_keys(child) -> tuple[str, ...]:
    """The per-element tensor state keys this child's optimizer keeps per parameter (never the master).

    Megatron's `optimizer_state_keys` (DistributedOptimizer, 0.19+) where the class has it; otherwise
    the keys the inner optimizer really holds; for an optimizer that has not stepped yet, the keys of
    its kind (Adam: both moments, Lion: one, Muon: its momentum buffer). Raises when megatron's
    answer and the real state disagree (state would be lost silently).
    """
    actual = _actual_state_keys(child)
    if isinstance(getattr(type(child), "optimizer_state_keys", None), property):
        declared = tuple(child.optimizer_state_keys)
        if actual and set(actual) != set(declared):
            raise ValueError(
                f"optimizer state holds {sorted(actual)} but megatron's optimizer_state_keys says "
                f"{list(declared)}: refusing to checkpoint a subset of the state"
            )
        return declared
    if actual:
        return actual
    kind = optimizer_kind(child)
    if kind == "adam" and any(g.get("amsgrad") for g in child.optimizer.param_groups):
        return (*_KEYS_BY_KIND["adam"], "max_exp_avg_sq")
    if kind in _KEYS_BY_KIND:
        return _KEYS_BY_KIND[kind]
    return _keys_from_config(child.config)


def _keys_from_config(config) -> tuple[str, ...]:
    name = getattr(config, "optimizer", "adam")
    if name in ("muon", "adaptive_muon"):
        name = getattr(config, "muon_scalar_optimizer", "adam")
    return _KEYS_BY_KIND.get(name, _KEYS_BY_KIND["adam"])


def _actual_state_keys(child) -> tuple[str, ...]:
    """Per-element tensor state keys of the inner optimizer (`step` and scalars excluded)."""
    inner = child.optimizer
    for group in inner.param_groups:
        for main_param in group["params"]:
            state = inner.state.get(main_param)
            if state:
                return tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == main_param.shape)
    return ()
