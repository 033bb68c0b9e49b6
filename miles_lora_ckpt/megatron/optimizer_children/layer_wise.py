"""The `layer-wise` family: Float16 / FP32 children under a LayerWiseDistributedOptimizer.

megatron's LayerWiseDistributedOptimizer (layer-wise Muon, `dist_muon`; Miles' multi-LoRA per-slot
chains) is a ChainedOptimizer that shards *whole* parameters over the DP ranks, in ping-pong order
of size (expert parameters over the expert-DP ranks): each parameter's master and moments live on
exactly one rank, and a child can have empty param groups on some ranks. Such a child is not a
stub: it holds nothing there, and it still has its param groups, which the scheduler steps.

Its children are the classes of the `replicated` family, so the state has the same per-parameter
format (replicated.py): each owner writes the entries it holds, and the plan maps every entry to its
file. What differs is the placement: an entry held by two ranks is refused (it would be saved
twice), and no replica digest applies. Children are numbered as `LayerWise.chained_optimizers`
numbers them, the numbering of Miles' `miles_slot_child_indices`, so one slot's children can be
saved and loaded alone (`chain.select`).

A DP-size change restores exactly (`dp_elastic`): parameters are never split, so each rank reads
the entries it owns at the new size, whichever rank wrote them.
"""

from __future__ import annotations

from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.megatron.optimizer_children.replicated import WholeParameterFamily

__all__ = [
    "FAMILY",
]

FAMILY = WholeParameterFamily(FamilyKind.LAYER_WISE)
