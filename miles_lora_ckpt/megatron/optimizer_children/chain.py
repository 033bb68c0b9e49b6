"""The optimizer chain as a saver sees it: a selection of children, and each phase over all of them.

A saver calls these between consensus agreements. Every one is local and may raise::

    save: describe -> plan -> collect -> exchange_for_save -> (the saver writes the files)
    load: describe -> files_to_read -> preflight -> allocate -> install

No family runs collectives: a DistributedOptimizer's DP ranks write and read their own slices.
Each rank describes its children as `family.ChildDescription` records. The manifest's child
records are read as `family.SavedChild` where they are used (`saved_record`).

`indices` chooses children by leaf index (`leaf_children`). For a LayerWise chain that is the
index in `chained_optimizers`, as in Miles' `miles_slot_child_indices`. None means every
non-stub child. Children outside the selection are never read, written, refreshed or rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.hyperparameters import Reconciler
from miles_lora_ckpt.megatron.adapter_shards import strip_wrappers
from miles_lora_ckpt.megatron.optimizer_children import FAMILIES, family_of
from miles_lora_ckpt.megatron.optimizer_children.child import (
    Child,
    has_state,
    leaf_children,
    never_stepped,
    optimizer_kind,
    resolve_state_keys,
)
from miles_lora_ckpt.megatron.optimizer_children.family import (
    ChildDescription,
    Collected,
    OptimizerFile,
    RankView,
    ReadContext,
    SavedChild,
)
from miles_lora_ckpt.megatron.topology import Coordinates

__all__ = [
    "active_indices",
    "allocate",
    "check_against",
    "collect",
    "covered_params",
    "describe",
    "exchange_for_save",
    "files_to_read",
    "install",
    "param_names",
    "param_states",
    "parse_description",
    "plan",
    "preflight",
    "recorded_states",
    "replaced_keys",
    "saved_record",
    "select",
]


def param_names(model) -> dict[int, str]:
    """`{id(parameter): "chunk{c}.{name}"}` of every parameter of every model chunk, wrappers stripped."""
    chunks = model if isinstance(model, list | tuple) else [model]
    return {
        id(param): f"chunk{index}.{strip_wrappers(name)}"
        for index, chunk in enumerate(chunks)
        for name, param in chunk.named_parameters()
    }


def select(optimizer, indices: Iterable[int] | None = None) -> list[Child]:
    """The non-stub leaf children of `optimizer`, all of them or those at `indices`.

    Raises ValueError naming indices the chain does not have.
    """
    leaves = leaf_children(optimizer)
    if indices is None:
        return [c for c in leaves if not c.is_stub]
    wanted = sorted(set(indices))
    unknown = [i for i in wanted if not 0 <= i < len(leaves)]
    if unknown:
        raise ValueError(f"optimizer children {unknown} do not exist: the chain has {len(leaves)} children")
    return [leaves[i] for i in wanted if not leaves[i].is_stub]


def param_states(child: Child) -> list[tuple]:
    """(model parameter, this rank's fp32 master (shard), its optimizer state) of every parameter here."""
    from miles_lora_ckpt.megatron.optimizer_children import distributed, replicated

    if family_of(child) is distributed.FAMILY:
        return distributed.param_states(child.optimizer)
    return [(model, main, state) for _, model, main, state in replicated.param_states(child.optimizer)]


def active_indices(optimizer) -> list[int]:
    """Every non-stub child's index on this rank (the chain's layout, whatever is selected)."""
    return [c.index for c in leaf_children(optimizer) if not c.is_stub]


# --------------------------------------------------------------------------- plan


def describe(optimizer, model, coords: Coordinates, indices=None, *, saving: bool = False) -> list[ChildDescription]:
    """This rank's `ChildDescription` of each selected child (`indices`; None: every non-stub one).

    `saving` lets a family digest its replicas. Raises ValueError for an unknown child index or
    a class no family knows, and what a family's `describe` raises.
    """
    names = param_names(model)
    described = []
    for child in select(optimizer, indices):
        family = family_of(child)
        described.append(
            ChildDescription(
                index=child.index,
                family=str(family.kind),
                class_name=child.class_name,
                kind=optimizer_kind(child.optimizer),
                keys=tuple(resolve_state_keys(child.optimizer)),
                has_state=has_state(child.optimizer),
                never_stepped=never_stepped(child.optimizer),
                held=family.describe(child, coords, names, saving),
            )
        )
    return described


def parse_description(data: dict) -> ChildDescription:
    """A `ChildDescription` from its JSON (`ChildDescription.to_json`), as a peer sent it.

    The family named in it parses its own fields. Raises KeyError for a family this package
    does not have.
    """
    return ChildDescription.parse(data, FAMILIES[data["family"]].parse_held)


def by_index(descriptions: Sequence[Sequence[ChildDescription]]) -> dict[int, list[ChildDescription | None]]:
    """`{child index: [each rank's description, None where the child is a stub or not selected]}`."""
    out: dict[int, list[ChildDescription | None]] = {}
    for rank, children in enumerate(descriptions):
        for desc in children:
            out.setdefault(desc.index, [None] * len(descriptions))[rank] = desc
    return out


def plan(
    descriptions: Sequence[Sequence[ChildDescription]], ranks: list[Coordinates], save_optim: bool
) -> dict[str, dict]:
    """Pure: what the checkpoint records for every selected child (manifest metadata, JSON).

    Takes every rank's descriptions and coordinates. Returns `{index: SavedChild.to_json()}`:
    family, class, kind, keys, stepped, and the family's `layout` (files and what they hold) for
    children saved with state. Raises ValueError, the same on every rank, where ranks disagree.
    """
    plans = {}
    for index, described in sorted(by_index(descriptions).items()):
        present = [(rank, d) for rank, d in enumerate(described) if d is not None]
        first_rank, first = present[0]
        for field, attribute in (("family", "family"), ("class", "class_name"), ("kind", "kind")):
            for rank, desc in present:
                if getattr(desc, attribute) != getattr(first, attribute):
                    raise ValueError(
                        f"optimizer child {index}: {field} {getattr(first, attribute)!r} on rank {first_rank}, "
                        f"{getattr(desc, attribute)!r} on rank {rank}: every rank must build the same chain"
                    )
        stateful = [(rank, d) for rank, d in present if d.has_state]
        keys = stateful[0][1].keys if stateful else first.keys
        for rank, desc in stateful:
            if set(desc.keys) != set(keys):
                raise ValueError(
                    f"optimizer child {index} keeps {list(desc.keys)} on rank {rank} but {list(keys)} elsewhere"
                )
        stepped = save_optim and bool(stateful)
        family = FAMILIES[first.family]
        layout = family.plan(index, described, ranks) if stepped else None
        record = SavedChild(first.family, first.class_name, first.kind, tuple(keys), stepped, layout)
        plans[str(index)] = record.to_json()
    return plans


def saved_record(saved: dict[str, dict], index: int) -> SavedChild | None:
    """Child `index` of the manifest's (or `plan`'s) JSON `{index: child}` as a `SavedChild`.

    Returns None where it has none. This is the JSON boundary: each entry is parsed where used, its
    layout into its family's record (GenerationDamaged where the JSON is not that record's shape).
    """
    entry = saved.get(str(index))
    return None if entry is None else SavedChild.parse(entry, index)


def covered_params(descriptions: Sequence[Sequence[ChildDescription]]) -> set[str]:
    """The names of every parameter the described children hold state for, on any rank."""
    return {name for children in descriptions for desc in children for name in desc.params}


# --------------------------------------------------------------------------- save


def collect(optimizer, view: RankView, plans: dict[str, dict]) -> dict[int, Collected]:
    """Local: each stepped child's contribution on this rank (copies; may raise)."""
    collected = {}
    for child in select(optimizer, [int(i) for i, p in plans.items() if p["stepped"]]):
        entry = saved_record(plans, child.index)
        collected[child.index] = family_of(child).collect(child, view, entry.layout, entry.keys)
    return collected


def exchange_for_save(
    optimizer, view: RankView, plans: dict[str, dict], collected: dict[int, Collected]
) -> dict[str, OptimizerFile]:
    """`{relpath: OptimizerFile}` this rank writes (tensors and their binding; no collectives),
    over every stepped child."""
    files: dict[str, OptimizerFile] = {}
    for child in select(optimizer, sorted(collected)):
        layout = saved_record(plans, child.index).layout
        files.update(family_of(child).exchange_for_save(child, view, layout, collected[child.index]))
    return files


def recorded_states(collected: dict[int, Collected]) -> dict[str, object]:
    """The JSON state this rank records for the training state, keyed as the families key it."""
    return {c.state_key: c.state for c in collected.values() if c.state_key is not None}


# --------------------------------------------------------------------------- load


def check_against(
    saved: dict[str, dict],
    descriptions: Sequence[Sequence[ChildDescription]],
    rank: int,
    dp_changed: bool,
    saved_selection=None,
) -> None:
    """Refuse, before anything is read or changed, a child that is not the one the checkpoint saved.

    Checks rank `rank`'s described children against `saved` (the manifest's JSON). Every refusal
    raises IncompatibleCheckpoint: the generation is intact, but not for this run. The load
    fails; it never falls back to an older generation.
    """
    for desc in descriptions[rank]:
        index = desc.index
        entry = saved_record(saved, index)
        if entry is None:
            hint = f" (a chosen-children save: pass optimizer_children={saved_selection})" if saved_selection else ""
            raise IncompatibleCheckpoint(
                f"the checkpoint holds no optimizer child {index}: it saved {sorted(map(int, saved))}{hint}"
            )
        saved_as = f"a {entry.class_name} over {entry.kind}"
        running = f"a {desc.class_name} over {desc.kind}"
        if entry.class_name != desc.class_name:
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: the checkpoint saved {saved_as}, this run has {running} "
                "(--use-distributed-optimizer or the optimizer changed?)"
            )
        if entry.family != desc.family:
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: the checkpoint saved {saved_as} ({entry.family}), this run has one "
                f"{'under' if desc.family == FamilyKind.LAYER_WISE else 'outside'} a LayerWiseDistributedOptimizer "
                f"({desc.family})"
            )
        if entry.kind != desc.kind or (entry.stepped and set(entry.keys) != set(desc.keys)):
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: checkpoint holds state {list(entry.keys)} of {entry.kind}, this run's "
                f"optimizer ({desc.kind}) keeps {list(desc.keys)} (different optimizer?); load with "
                "weights_only=True to warm-start"
            )
        if dp_changed and entry.stepped and not FAMILIES[entry.family].dp_elastic:
            raise IncompatibleCheckpoint(
                f"optimizer child {index} ({entry.family}) cannot be restored exactly at another data-parallel size"
            )


def files_to_read(view: RankView, descriptions: Sequence[Sequence[ChildDescription]], saved: dict[str, dict]) -> list:
    """The optimizer files (relpaths, or `PartialRead`s) this rank reads to restore every described
    child saved with state. Raises IncompatibleCheckpoint where a family cannot restore one."""
    files: list = []
    for index, described in sorted(by_index(descriptions).items()):
        entry = saved_record(saved, index)
        if entry.stepped and described[view.rank] is not None:
            family = FAMILIES[entry.family]
            files += [f for f in family.files_to_read(index, view, described, entry.layout) if f not in files]
    return files


def preflight(
    optimizer,
    view: RankView,
    descriptions,
    saved: dict[str, dict],
    tensors,
    states: dict,
    ranges=None,
    adapter=None,
    hyperparameters=None,
) -> dict:
    """Local, no mutation: `{index: restore}` for every described child saved with state.

    `tensors(relpath, binding)` reads one of this rank's files. `ranges(relpath, binding)` reads
    the element ranges it asked of one. Both refuse a file bound to anything else (`ReadContext`).
    `adapter(model parameter)` is the saved adapter tensor restored into it: every restored master
    must be its cast (`masters.check_master`; None: not checked). `hyperparameters` is the
    `core.hyperparameters.Reconciler` every saved param group goes through (None: report only).
    Raises what a family's preflight raises (IncompatibleCheckpoint, GenerationDamaged, ValueError).
    """
    restores = {}
    described = by_index(descriptions)
    for child in select(optimizer, [d.index for d in descriptions[view.rank]]):
        entry = saved_record(saved, child.index)
        if entry.stepped:
            read = ReadContext(tensors, states, entry.keys, ranges, adapter, hyperparameters or Reconciler())
            restores[child.index] = family_of(child).preflight(child, view, described[child.index], entry.layout, read)
    return restores


def allocate(optimizer, restores: dict) -> None:
    """First mutation: state allocated where a family needs it before receiving."""
    for child in select(optimizer, sorted(restores)):
        family_of(child).allocate(child, restores[child.index])


def replaced_keys(optimizer, restores: dict) -> dict[int, tuple[str, ...]]:
    """`{id(child optimizer): state keys}` that `install` replaces instead of writing (the family's
    `replaces`), for `undo.UndoRecord.capture`: those old tensors need no copy."""
    out = {}
    for child in select(optimizer, sorted(restores)):
        keys = family_of(child).replaces(restores[child.index])
        if keys:
            out[id(child.optimizer)] = tuple(keys)
    return out


def install(optimizer, restores: dict) -> None:
    """Copy into masters and state, param groups too, then read every tensor back bit for bit."""
    for child in select(optimizer, sorted(restores)):
        family_of(child).install(child, restores[child.index])
