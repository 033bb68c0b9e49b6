"""What the single-LoRA saver and loader share: file names, each rank's plan, what another saver
adds to their phases (`SaverSpec`), the load result.

A generation written by the single-LoRA saver holds (paths relative to it)::

    training_state.json                                   iteration, scheduler, per-child optimizer
                                                          param groups and steps (JSON), by rank 0
    adapter/dense_tp000_pp000.safetensors                 dense adapter shard per (TP, PP), all chunks
    adapter/expert_pp000_ep000_etp000.safetensors         expert adapter shard per (PP, EP, ETP)
    optimizer/child1_tp000_pp000_ep000_etp000_s000of002.safetensors
                                                          DP rank 0 of 2's slice of the fp32 masters and
                                                          every moment of one DistributedOptimizer
                                                          child, keyed by the model-parallel coordinate
                                                          of its DP group's root (DP x CP for dense
                                                          children); no gather, partial reads at load
    optimizer/child0_tp000_pp000_ep000_etp000_dp000_cp000.safetensors
                                                          masters + state of the whole parameters a
                                                          Float16/FP32 (or layer-wise) child's rank writes

(`megatron.optimizer_children` says which family writes which files.) Format v2 binds every file
to what it is: the training state (role `training-state`), each adapter shard (role
`dense-adapter` / `expert-adapter` and its coordinate), each optimizer file (role `optimizer`, the
child and the writer's coordinate: `optimizer_children.file_binding`); the protocol stamps the
binding into tensor files and the manifest records it, and the loader checks it for every file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.layout import ROLE_TRAINING_STATE
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import param_blocks
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.optimizer_children.family import RankView
from miles_lora_ckpt.megatron.topology import Coordinates, current_coordinates, current_topology
from miles_lora_ckpt.savers.options import LoadSource
from miles_lora_ckpt.savers.peft_export import GENERATION_SUBDIR

SAVER = "single-lora"
TRAINING_STATE = "training_state.json"


# What each file is (format v2): stamped into tensor files, recorded in the manifest, checked on load.
# (Optimizer files: `optimizer_children.file_binding`.)
TRAINING_STATE_BINDING = {"role": ROLE_TRAINING_STATE}


@dataclass(frozen=True)
class SaverSpec:
    """What another saver (multi-LoRA slots) adds to the single-LoRA save and load phases.

    Both: `saver`, the manifest's saver name written and accepted; `adapter_filter(name)`, the
    adapter weights saved or restored (chunk-qualified names; None: all), with the empty-shard guard
    (`filtered_adapter_names`; a load must find every one of them on this rank in its file).
    Save: `links`, reader names the publish points at the generation (`save_generation`'s links);
    `extra_metadata(layout)`, more manifest metadata from the agreed layout; `export_after_write`,
    with a PEFT export, run it after every rank's files are staged (Miles v1's order);
    `peft_prefix`, where the PEFT files go (`peft/`, or "" for the generation's top).
    Load: `check_manifest(manifest)`, more refusals (raise IncompatibleCheckpoint) before anything
    is read; `legacy`, whether a stock Miles adapter directory may be warm-started.
    """

    saver: str = SAVER
    adapter_filter: Callable[[str], bool] | None = None
    links: Sequence[str] = ()
    extra_metadata: Callable[[Any], dict] | None = None
    export_after_write: bool = False
    peft_prefix: str = GENERATION_SUBDIR
    check_manifest: Callable[[Any], None] | None = None
    legacy: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(self.links))


SINGLE_LORA = SaverSpec()  # the single-LoRA saver itself


def adapter_binding(kind: str, coordinate_key: str) -> dict[str, str]:
    """`kind` is "dense" (coordinate: TP, PP) or "expert" (coordinate: PP, EP, expert TP)."""
    return {"role": f"{kind}-adapter", "coordinate": coordinate_key}


def check_binding(opened, relpath: str, expected: dict[str, str]) -> None:
    """The manifest must bind `relpath` to what this rank expects there (format v2; v1 has no
    bindings: a v1 file swapped or copied is caught only by the manifest's digests)."""
    if opened.manifest.format_version < 2:
        return
    found = opened.binding(relpath)
    if found != expected:
        raise ValueError(f"{relpath}: the manifest binds it to {found or 'nothing'}, expected {expected}")


def bound_tensors(opened):
    """`(relpath, expected binding) -> tensors` of one of this rank's files, binding checked first."""

    def read(relpath: str, expected: dict[str, str]):
        check_binding(opened, relpath, expected)
        return opened.tensors(relpath)

    return read


def bound_ranges(opened):
    """`(relpath, expected binding) -> {(name, first, stop): tensor}`: the element ranges this rank
    asked of one of its files (`protocol.PartialRead`), binding checked first."""

    def read(relpath: str, expected: dict[str, str]):
        check_binding(opened, relpath, expected)
        return opened.tensor_ranges(relpath)

    return read


def saved_metadata(manifest, *keys):
    """`manifest.metadata[k1][k2]...`, or a ValueError naming the missing key."""
    value = manifest.metadata
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            path = ".".join(str(k) for k in keys[: depth + 1])
            raise GenerationDamaged(
                f"manifest metadata has no {path!r} (written by another saver or version, or edited)"
            )
        value = value[key]
    return value


# Before every child family was saved, the manifest described DistributedOptimizer children only,
# in three keys; `saved_children` reads those generations too.
_PRE_FAMILY_KEYS = ("stepped_children", "state_keys", "numel_unpadded")


def saved_children(manifest) -> dict[str, dict]:
    """The manifest's `optimizer_children` (per child: family, class, kind, keys, stepped, layout).

    A generation written before every child family was saved records `stepped_children`,
    `state_keys` and `numel_unpadded` instead (DistributedOptimizer children only, the same files
    and bindings): those read as the equivalent `optimizer_children`. A ValueError names a missing key.
    """
    metadata = manifest.metadata
    if "optimizer_children" in metadata or not all(k in metadata for k in _PRE_FAMILY_KEYS):
        return saved_metadata(manifest, "optimizer_children")
    stepped = {int(i) for i in metadata["stepped_children"]}
    children = {}
    for index, keys in metadata["state_keys"].items():
        keys = list(keys)
        children[str(index)] = {
            "family": "distributed",
            "class": "DistributedOptimizer",
            "kind": "adam" if "exp_avg_sq" in keys else ("lion" if keys == ["exp_avg"] else "unknown"),
            "keys": keys,
            "stepped": int(index) in stepped,
            "layout": {"numel_unpadded": saved_metadata(manifest, "numel_unpadded", str(index))}
            if int(index) in stepped
            else {},
        }
    return children


def chunk_count(model) -> int:
    return len(model) if isinstance(model, list | tuple) else 1


def describe_rank(model, optimizer, optimizer_children=None, *, saving: bool = False) -> dict:
    """What this rank holds: coordinates, adapter shards it would write, optimizer children (JSON).

    `children` describes the selected children only (all non-stub ones when `optimizer_children`
    is None); `active` lists every non-stub child, the chain's layout; `global` each trainable
    parameter's place in the global model (`megatron.param_blocks`).
    """
    coords = current_coordinates()
    dense, expert = shards.split_by_kind(shards.adapter_params(model))
    has_optimizer = optimizer is not None
    return {
        "coords": coords.to_dict(),
        "topology": current_topology(chunk_count(model)).to_dict(),
        "dense": sorted(dense),
        "expert": sorted(expert),
        "global": param_blocks.describe(model),  # each trainable parameter's global block (format v3)
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


def filtered_adapter_names(plans: list[dict], optimizer_children, adapter_filter) -> set[str] | None:
    """The adapter names a save or load covers: all (None), those the chosen children step, or
    those `adapter_filter` accepts among every rank's adapters.

    With a filter (a multi-LoRA slot), the empty-shard guard: it must accept at least one adapter
    parameter on some rank and, with chosen children, exactly the parameters they step (a filter
    that misses slot-indexed names would otherwise write valid but empty or partial shards).
    Raises ValueError, the same on every rank (they all see the same plans).
    """
    stepped = selected_adapter_names(plans, optimizer_children)
    if adapter_filter is None:
        return stepped
    held = sorted({n for p in plans for n in (*p["dense"], *p["expert"])})
    chosen = {n for n in held if adapter_filter(n)}
    if not chosen:
        raise ValueError(
            f"empty slot shard: the slot's adapter filter accepts none of the {len(held)} adapter parameters "
            f"on any rank (e.g. {held[:2]})"
        )
    if stepped is not None and stepped != chosen:
        missed, extra = sorted(stepped - chosen), sorted(chosen - stepped)
        raise ValueError(
            "incomplete slot shard: the slot's adapter filter and its optimizer children disagree: "
            f"{len(missed)} parameter(s) stepped by the children but not accepted by the filter {missed[:3]}, "
            f"{len(extra)} accepted but not stepped by them {extra[:3]}"
        )
    return chosen


@dataclass
class LoadResult:
    """What `load_lora_checkpoint` restored, so that callers step nothing twice."""

    loaded: bool
    iteration: int | None
    source: LoadSource  # what it restored from (a str: "generation", "legacy-miles", "native-dist", "none")
    path: str | None = None
    adapter_restored: bool = False
    optimizer_restored: bool = False  # fp32 masters and every moment of every stepped child
    scheduler_restored: bool = False  # False with a scheduler: it was repositioned from the iteration
    masters_refreshed: bool = False  # masters copied from the loaded adapter (no saved masters used)
    rng_restored: bool = False  # every RNG state of this rank (Python, numpy, torch, CUDA, megatron's tracker)
    rng_note: str | None = None  # why not, at another layout (rank 0 logs it once)
    warnings: list[str] = field(default_factory=list)
    # each checkpoint hyperparameter that differs from the launch's, both values named, and how it
    # was settled (core.hyperparameters); rank 0 also logs them as warnings
    hyperparameter_differences: list[str] = field(default_factory=list)
