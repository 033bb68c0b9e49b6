"""What the single-LoRA saver and loader share: file names, each rank's plan, the load result.

A generation written by the single-LoRA saver holds (paths relative to it)::

    training_state.json                                   iteration, scheduler, per-child optimizer
                                                          param groups and steps (JSON), by rank 0
    adapter/dense_tp000_pp000.safetensors                 dense adapter shard per (TP, PP)
    adapter/expert_pp000_ep000_etp000.safetensors         expert adapter shard per (PP, EP, ETP)
    optimizer/child1_tp000_pp000_ep000_etp000.safetensors fp32 masters + every moment of one
                                                          DistributedOptimizer child, per coordinate
                                                          of its DP root
    optimizer/child0_tp000_pp000_ep000_etp000_dp000_cp000.safetensors
                                                          masters + state of the whole parameters a
                                                          Float16/FP32 (or layer-wise) child's rank writes

(`megatron.optimizer_children` says which family writes which files.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.optimizer_children.family import RankView
from miles_lora_ckpt.megatron.topology import Coordinates, current_coordinates, current_topology

SAVER = "single-lora"
TRAINING_STATE = "training_state.json"


def chunk_count(model) -> int:
    return len(model) if isinstance(model, list | tuple) else 1


def describe_rank(model, optimizer, optimizer_children=None, *, saving: bool = False) -> dict:
    """What this rank holds: coordinates, adapter shards it would write, optimizer children (JSON).

    `children` describes the selected children only (all non-stub ones when `optimizer_children`
    is None); `active` lists every non-stub child, the chain's layout.
    """
    coords = current_coordinates()
    dense, expert = shards.split_by_kind(shards.adapter_params(model))
    has_optimizer = optimizer is not None
    return {
        "coords": coords.to_dict(),
        "topology": current_topology(chunk_count(model)).to_dict(),
        "dense": sorted(dense),
        "expert": sorted(expert),
        "active": chain.active_indices(optimizer) if has_optimizer else [],
        "children": chain.describe(optimizer, model, coords, optimizer_children, saving=saving)
        if has_optimizer
        else [],
    }


def rank_view(model, plans: list[dict], rank: int) -> RankView:
    return RankView(rank, [Coordinates(**p["coords"]) for p in plans], chain.param_names(model))


def selected_adapter_names(plans: list[dict], optimizer_children) -> set[str] | None:
    """With a child selection, the adapter parameters those children step (on any rank); else None (all)."""
    if optimizer_children is None:
        return None
    return chain.covered_params([p["children"] for p in plans])


@dataclass
class LoadResult:
    """What `load_lora_checkpoint` restored, so that callers step nothing twice."""

    loaded: bool
    iteration: int | None
    source: str  # "generation", "legacy-miles" or "none"
    path: str | None = None
    adapter_restored: bool = False
    optimizer_restored: bool = False  # fp32 masters and every moment of every stepped child
    scheduler_restored: bool = False  # False with a scheduler: it was repositioned from the iteration
    masters_refreshed: bool = False  # masters copied from the loaded adapter (no saved masters used)
    warnings: list[str] = field(default_factory=list)
