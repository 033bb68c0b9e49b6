"""What the single-LoRA saver and loader share: file names, bindings, each rank's plan.

Each rank's plan is a `RankPlan`, agreed as JSON (`agree_plans`). `SaverSpec` says what another
saver (multi-LoRA slots) adds to the phases; `LoadResult` is what a load restored.

docs/file-format.md lists a generation's files. Format v2 binds every file to what it is (role,
coordinate, child): the protocol stamps the binding into tensor files and the manifest records
it. The loader checks it for every file (`check_binding`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lora_ckpt.core.consensus import Outcome
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.layout import ROLE_TRAINING_STATE, Topology
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import param_blocks
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.optimizer_children.family import ChildDescription, RankView
from miles_lora_ckpt.megatron.topology import Coordinates, current_coordinates, current_topology
from miles_lora_ckpt.savers.options import LoadSource
from miles_lora_ckpt.savers.peft_export import GENERATION_SUBDIR

__all__ = [
    "SAVER",
    "SINGLE_LORA",
    "TRAINING_STATE",
    "TRAINING_STATE_BINDING",
    "LoadResult",
    "RankPlan",
    "SaverSpec",
    "adapter_binding",
    "agree_plans",
    "bound_ranges",
    "bound_tensors",
    "check_binding",
    "chunk_count",
    "describe_rank",
    "filtered_adapter_names",
    "rank_view",
    "saved_children",
    "saved_metadata",
]

SAVER = "single-lora"
TRAINING_STATE = "training_state.json"


# What each file is (format v2): stamped into tensor files, recorded in the manifest, checked on
# load.
# (Optimizer files: `optimizer_children.file_binding`.)
TRAINING_STATE_BINDING = {"role": ROLE_TRAINING_STATE}


@dataclass(frozen=True)
class SaverSpec:
    """What another saver (multi-LoRA slots) adds to the single-LoRA save and load phases.

    Both phases: `saver` is the manifest's saver name, written and accepted. `adapter_filter(name)`
    picks the adapter weights saved or restored (chunk-qualified names; None: all). The empty-shard
    guard applies to it (`filtered_adapter_names`): a load must find each of them in its file.

    Save: `links` are the reader names the publish points at the generation.
    `extra_metadata(layout)` adds manifest metadata from the agreed layout. `export_after_write` runs a PEFT export after
    every rank's files are staged (Miles v1's order). `peft_prefix` is where the PEFT files go
    (`peft/`, or "" for the generation's top).

    Load: `check_manifest(manifest)` adds refusals (it raises IncompatibleCheckpoint) before
    anything is read. `legacy` says whether a stock Miles adapter directory may be warm-started.
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
    """The binding of an adapter shard: `kind` "dense" (coordinate: TP, PP) or "expert" (PP, EP,
    expert TP), at `coordinate_key`."""
    return {"role": f"{kind}-adapter", "coordinate": coordinate_key}


def check_binding(opened, relpath: str, expected: dict[str, str]) -> None:
    """Raise ValueError unless the manifest of `opened` binds `relpath` to `expected`.

    Format v1 has no bindings: there a swapped or copied file is caught by the digests only.
    """
    if opened.manifest.format_version < 2:
        return
    found = opened.binding(relpath)
    if found != expected:
        raise ValueError(f"{relpath}: the manifest binds it to {found or 'nothing'}, expected {expected}")


def bound_tensors(opened):
    """`(relpath, expected binding) -> tensors` of one of this rank's files, binding checked
    first."""

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
    """`manifest.metadata[k1][k2]...`; raises GenerationDamaged naming the missing key."""
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
    """The manifest's `optimizer_children`, JSON: per child family, class, kind, keys, stepped, layout.

    Older generations record DistributedOptimizer children only, in `stepped_children`,
    `state_keys` and `numel_unpadded`. Those read as the equivalent `optimizer_children`.
    Raises GenerationDamaged naming a missing key.
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
    """How many model chunks `model` is (Miles passes a list of chunks, or one module)."""
    return len(model) if isinstance(model, list | tuple) else 1


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds, as every rank sees it after the plan agreement.

    `describe_rank` makes it; it crosses the consensus as JSON (`to_json`, `from_json`), and every
    use reads its attributes. `global_blocks` goes into the manifest as is (format v3).
    """

    coords: Coordinates  # this rank's place on every parallel axis
    topology: Topology  # the whole run's layout, as this rank sees it
    dense: tuple[str, ...]  # the dense adapter weights it holds, sorted
    expert: tuple[str, ...]  # the expert adapter weights it holds, sorted
    # each trainable parameter's global block (`param_blocks.describe`, JSON; None where unknown)
    global_blocks: dict[str, dict | None]
    active: tuple[int, ...]  # every non-stub optimizer child's index (the chain's layout)
    children: tuple[ChildDescription, ...]  # the selected children (`chain.describe`)

    def to_json(self) -> dict:
        """The consensus payload: plain JSON under the keys the plan always had."""
        return {
            "coords": self.coords.to_dict(),
            "topology": self.topology.to_dict(),
            "dense": list(self.dense),
            "expert": list(self.expert),
            "global": self.global_blocks,
            "active": list(self.active),
            "children": [child.to_json() for child in self.children],
        }

    @classmethod
    def from_json(cls, data: dict) -> RankPlan:
        """The record back from `to_json`'s payload, as a peer sent it."""
        return cls(
            coords=Coordinates(**data["coords"]),
            topology=Topology(**data["topology"]),
            dense=tuple(data["dense"]),
            expert=tuple(data["expert"]),
            global_blocks=data["global"],
            active=tuple(data["active"]),
            children=tuple(chain.parse_description(child) for child in data["children"]),
        )


def describe_rank(model, optimizer, optimizer_children=None, *, saving: bool = False) -> RankPlan:
    """This rank's `RankPlan`: coordinates, layout, adapter shards, parameter blocks, children.

    `optimizer_children` selects the children described (None: every non-stub one); `active`
    lists every non-stub child whatever is selected. `saving` tells the families a save asks.
    Raises what megatron's parallel state or a family's description raises.
    """
    coords = current_coordinates()
    dense, expert = shards.split_by_kind(shards.adapter_params(model))
    has_optimizer = optimizer is not None
    return RankPlan(
        coords=coords,
        topology=current_topology(chunk_count(model)),
        dense=tuple(sorted(dense)),
        expert=tuple(sorted(expert)),
        global_blocks=param_blocks.describe(model),
        active=tuple(chain.active_indices(optimizer)) if has_optimizer else (),
        children=tuple(chain.describe(optimizer, model, coords, optimizer_children, saving=saving))
        if has_optimizer
        else (),
    )


def agree_plans(consensus, planned: Outcome) -> list[RankPlan]:
    """Collective: every rank's `RankPlan`, by rank, from this rank's `attempt(describe_rank, ...)`.

    The plans cross as JSON. Raises CheckpointError (phase `plan`) on every rank where any failed.
    """
    return [RankPlan.from_json(p) for p in consensus.agree("plan", planned.map(RankPlan.to_json))]


def rank_view(model, plans: list[RankPlan], rank: int) -> RankView:
    """What a family needs of the run: `rank`, every rank's coordinates, the parameter names."""
    return RankView(rank, [p.coords for p in plans], chain.param_names(model))


def selected_adapter_names(plans: list[RankPlan], optimizer_children) -> set[str] | None:
    """With a child selection, the adapter parameters those children step on any rank; else None."""
    if optimizer_children is None:
        return None
    return chain.covered_params([p.children for p in plans])


def filtered_adapter_names(plans: list[RankPlan], optimizer_children, adapter_filter) -> set[str] | None:
    """The adapter names a save or load covers, from every rank's plan.

    Returns None (all), the names the chosen children step, or those `adapter_filter` accepts.
    A filter (a multi-LoRA slot) gets the empty-shard guard: it must accept some adapter
    parameter, and with chosen children exactly those they step. Otherwise a filter that misses
    slot-indexed names would write valid but empty or partial shards. Raises ValueError, the same
    on every rank (they all see the same plans).
    """
    stepped = selected_adapter_names(plans, optimizer_children)
    if adapter_filter is None:
        return stepped
    held = sorted({n for p in plans for n in (*p.dense, *p.expert)})
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
