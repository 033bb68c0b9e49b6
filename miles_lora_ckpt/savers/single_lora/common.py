"""What the single-LoRA saver and loader share: file names, each rank's plan, the load result.

A generation written by the single-LoRA saver holds (paths relative to it)::

    training_state.json                                   iteration, scheduler, per-child optimizer
                                                          param groups (JSON), written by rank 0
    adapter/dense_tp000_pp000.safetensors                 dense adapter shard per (TP, PP)
    adapter/expert_pp000_ep000_etp000.safetensors         expert adapter shard per (PP, EP, ETP)
    optimizer/child1_tp000_pp000_ep000_etp000.safetensors fp32 masters + every moment of one child,
                                                          per model-parallel coordinate of its DP root
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_lora_ckpt.core.layout import ROLE_TRAINING_STATE
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import optimizer_state as ostate
from miles_lora_ckpt.megatron.topology import current_coordinates, current_topology

SAVER = "single-lora"
TRAINING_STATE = "training_state.json"


def optimizer_file(child_index: int, coordinate_key: str) -> str:
    return f"optimizer/child{child_index}_{coordinate_key}.safetensors"


# What each file is (format v2): stamped into tensor files, recorded in the manifest, checked on load.
TRAINING_STATE_BINDING = {"role": ROLE_TRAINING_STATE}


def adapter_binding(kind: str, coordinate_key: str) -> dict[str, str]:
    """`kind` is "dense" (coordinate: TP, PP) or "expert" (coordinate: PP, EP, expert TP)."""
    return {"role": f"{kind}-adapter", "coordinate": coordinate_key}


def optimizer_binding(child_index: int, coordinate_key: str) -> dict[str, str]:
    return {"role": "optimizer", "coordinate": coordinate_key, "child": str(child_index)}


def check_binding(opened, relpath: str, expected: dict[str, str]) -> None:
    """The manifest must bind `relpath` to what this rank expects there (format v2; v1 has no
    bindings: a v1 file swapped or copied is caught only by the manifest's digests)."""
    if opened.manifest.format_version < 2:
        return
    found = opened.binding(relpath)
    if found != expected:
        raise ValueError(f"{relpath}: the manifest binds it to {found or 'nothing'}, expected {expected}")


def saved_metadata(manifest, *keys):
    """`manifest.metadata[k1][k2]...`, or a ValueError naming the missing key."""
    value = manifest.metadata
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            path = ".".join(str(k) for k in keys[: depth + 1])
            raise ValueError(f"manifest metadata has no {path!r} (written by another saver or version, or edited)")
        value = value[key]
    return value


def chunk_count(model) -> int:
    return len(model) if isinstance(model, list | tuple) else 1


def describe_rank(model, optimizer) -> dict:
    """What this rank holds: coordinates, adapter shards it would write, optimizer children."""
    coords = current_coordinates()
    dense, expert = shards.split_by_kind(shards.adapter_params(model))
    children = []
    if optimizer is not None:
        for index, child in enumerate(ostate.optimizer_children(optimizer)):
            if ostate.is_stub(child):
                continue
            group = child.data_parallel_group_gloo  # None with gloo groups disabled: checked when needed
            children.append(
                {
                    "index": index,
                    "dp_rank": group.rank() if group is not None else None,
                    "dp_size": group.size() if group is not None else None,
                    "has_params": ostate.local_param_count(child) > 0,
                    "has_state": ostate.has_state(child),
                    "keys": list(ostate.resolve_state_keys(child)),
                    "numel_unpadded": ostate.unpadded_numels(child),
                }
            )
    return {
        "coords": coords.to_dict(),
        "topology": current_topology(chunk_count(model)).to_dict(),
        "dense": sorted(dense),
        "expert": sorted(expert),
        "children": children,
    }


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
