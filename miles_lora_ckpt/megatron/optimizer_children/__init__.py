"""Optimizer state of every child optimizer megatron hands a LoRA run: one module per child family.

`get_megatron_optimizer` returns a chain whose leaves ("children") are, for LoRA:

    family       classes                                    where the fp32 masters and moments live
    distributed  DistributedOptimizer                       element-wise shards of the grad buffers
                                                            over the child's DP group (distributed.py)
    replicated   Float16OptimizerWithFloat16Params,         whole parameters, the same on every DP rank
                 FP32Optimizer                              (Muon, megatron 0.19's Lion; replicated.py)
    layer-wise   the same two classes under a               whole parameters, each on one DP rank
                 LayerWiseDistributedOptimizer              (layer-wise Muon, multi-LoRA slots; layer_wise.py)

Stubs (megatron's `is_stub_optimizer`, no parameters anywhere) hold nothing and are skipped. A
layer-wise child whose param groups are empty on some ranks is not a stub: it holds nothing there.

Every family implements `ChildFamily`, the same phases in the same order, so a saver runs them for
any selection of children (`chain.select`) with a consensus between any two:

    save:  describe -> plan -> collect (local) -> exchange_for_save -> write files
    load:  describe -> files_to_read -> preflight (no mutation) -> allocate
           -> install (copies, then reads everything back bit for bit)

(No family runs collectives: every rank of every family writes and reads its own files, a
DistributedOptimizer's DP ranks their own slices.) Each family is named by its
`core.family_kind.FamilyKind` (the manifest's `family`), its module by that name; `replicated` and
`layer-wise` share one implementation (`replicated.WholeParameterFamily`) and one file format.

`chain` runs the phases over the selected children; a saver never touches a child it did not
select (its masters, moments and param groups stay bit-identical; nothing is refreshed from bf16).
Files are safetensors, non-tensor state is JSON, all keyed by parallel coordinate (never by global
rank); every file is bound (format v2) to its child and coordinate (`family.file_binding`), and each
family's preflight reads its files through that binding check.
"""

from __future__ import annotations

from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.megatron.optimizer_children import distributed, layer_wise, replicated
from miles_lora_ckpt.megatron.optimizer_children.child import (
    DISTRIBUTED,
    FLOAT16,
    FP32,
    MASTER_KEY,
    SUPPORTED_CLASSES,
    Child,
    class_name,
    has_state,
    is_stub,
    leaf_children,
    optimizer_kind,
    resolve_state_keys,
)
from miles_lora_ckpt.megatron.optimizer_children.family import (
    ChildFamily,
    Collected,
    OptimizerFile,
    RankView,
    ReadContext,
    file_binding,
)

FAMILIES: dict[FamilyKind, ChildFamily] = {
    f.kind: f for f in (distributed.FAMILY, replicated.FAMILY, layer_wise.FAMILY)
}


def family_of(child: Child) -> ChildFamily:
    """The family that saves `child`; ValueError for a class no family knows (never ask for a stub)."""
    name = child.class_name
    if name == DISTRIBUTED and not child.layer_wise:
        return distributed.FAMILY
    if name in (FLOAT16, FP32):
        return layer_wise.FAMILY if child.layer_wise else replicated.FAMILY
    inner = type(getattr(child.optimizer, "optimizer", None)).__name__
    raise ValueError(
        f"optimizer child {child.index} is a {name} (inner optimizer {inner}), which miles-lora-ckpt cannot "
        f"checkpoint: supported are {DISTRIBUTED}, {FLOAT16} and {FP32}, alone or under a "
        "LayerWiseDistributedOptimizer"
    )


__all__ = [
    "DISTRIBUTED",
    "FAMILIES",
    "SUPPORTED_CLASSES",
    "MASTER_KEY",
    "Child",
    "ChildFamily",
    "Collected",
    "OptimizerFile",
    "RankView",
    "ReadContext",
    "class_name",
    "family_of",
    "file_binding",
    "has_state",
    "is_stub",
    "leaf_children",
    "optimizer_kind",
    "resolve_state_keys",
]
