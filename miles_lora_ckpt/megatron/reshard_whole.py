"""Resharding the whole-parameter children: Float16 / FP32 (`replicated`) and layer-wise ones.

Their files hold, per parameter shard, the fp32 master and every state tensor of the whole local
parameter (`optimizer_children.replicated`: entries `{slice}:{name}`). At another layout a rank's
parameter is assembled, like an adapter weight, from the saved blocks of the same global tensor
(`core.global_layout.plan_copies`): the master and every per-element state key element by element;
a 0-d state (a torch optimizer's `step`) must be the same in every saved block it draws from. The
files it draws from are read whole. The param groups and grad scaler come from the saved
coordinates it draws from, which must agree. The install is the same-layout one
(`WholeParameterFamily.install`: read back bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.global_layout import Block, distinct, plan_copies
from miles_lora_ckpt.core.jsoncodec import from_json
from miles_lora_ckpt.megatron.optimizer_children import replicated
from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY
from miles_lora_ckpt.megatron.optimizer_children.family import file_binding
from miles_lora_ckpt.megatron.optimizer_children.masters import check_master


@dataclass(frozen=True)
class _Entry:
    file: str
    name: str  # chunk-qualified name in that file
    block: Block
    group: int
    coordinate: str  # the saved model-parallel coordinate it belongs to (param groups are recorded there)


@dataclass
class WholePlan:
    """One whole-parameter child on this rank: per parameter (group, master, [(entry, copy)])."""

    index: int
    files: dict[str, str]  # file -> its writer's coordinate (binding)
    params: list[tuple[int, str, torch.Tensor, list, torch.Tensor]]  # (group, name, master, [(entry, copy)], param)
    coordinates: list[str]


def plan_child(index: int, layout: dict, child, names: dict, mine: dict, saved: dict, block_of) -> WholePlan:
    """Plan this rank's parameters of one child (nothing read); IncompatibleCheckpoint what cannot map."""
    sources: dict[str, list[_Entry]] = {}
    for entry, where in sorted(layout.get("entries", {}).items()):
        shard, _, name = entry.partition(":")
        # the block its writer's own coordinate records (that file's layout stamp binds those), else
        # the first coordinate of its shard that describes it
        own = "_".join(str(layout.get("files", {}).get(where.get("file"), "")).split("_")[:4])
        coordinate = own if saved.get(own, {}).get(name) is not None else _coordinate_of(shard, name, saved)
        if coordinate is None:
            raise ValueError(f"optimizer child {index}: the global layout has no block for {entry}")
        block = saved[coordinate][name]
        sources.setdefault(block.name, []).append(_Entry(where["file"], name, block, where["group"], coordinate))
    plan = WholePlan(index, {}, [], [])
    used = set()
    for group, model_param, main, _ in replicated.param_states(child):
        name = names[id(model_param)]
        block = block_of(mine, name)
        found = sources.get(block.name, [])
        found = [found[i] for i in distinct([s.block for s in found])]
        try:
            copies = plan_copies(block, 0, block.numel, [s.block for s in found])
        except ValueError as exc:
            raise IncompatibleCheckpoint(f"optimizer child {index}, parameter {name}: {exc}") from None
        pieces = []
        for copy in copies:
            source = found[copy.source]
            if source.group != group:
                raise IncompatibleCheckpoint(
                    f"optimizer child {index}: {name} is in param group {group}, the checkpoint has "
                    f"{source.block.name} in group {source.group}"
                )
            pieces.append((source, copy))
            plan.files[source.file] = layout["files"][source.file]
            used.add(source.coordinate)
        plan.params.append((group, name, main, pieces, model_param))
    plan.coordinates = sorted(used)
    return plan


def _coordinate_of(shard: str, name: str, saved: dict) -> str | None:
    """The saved model-parallel coordinate (`tp000_pp000_ep000_etp000`) of an entry's shard key
    (`tp000_pp000` dense, `pp000_ep000_etp000` expert) that describes `name`."""
    for coordinate in sorted(saved):
        tp, pp, ep, etp = coordinate.split("_")
        if shard in (f"{tp}_{pp}", f"{pp}_{ep}_{etp}") and saved[coordinate].get(name) is not None:
            return coordinate
    return None


def restore(
    plan: WholePlan,
    child,
    read_tensors,
    state: dict,
    keys_wanted: tuple[str, ...],
    hyperparameters=None,
    adapter=None,
) -> replicated._Restore:
    """Read the files (binding checked) and assemble every parameter's master and state; the saved
    param groups are checked against the live ones by `hyperparameters` (a `Reconciler`) if given,
    every assembled master against the adapter weight `adapter(model parameter)` restored into it
    (`masters.check_master`: the adapter must be its cast) if given."""
    groups = [from_json(g) for g in state["param_groups"]]
    current = child.optimizer.param_groups
    if len(groups) != len(current):
        raise IncompatibleCheckpoint(
            f"optimizer child {plan.index}: the checkpoint has {len(groups)} param group(s), this run {len(current)}"
        )
    if hyperparameters is not None:
        hyperparameters.param_groups(f"optimizer child {plan.index}", groups, current)
    out = replicated._Restore(groups, state.get("grad_scaler"))
    files = {
        file: replicated._by_parameter(read_tensors(file, file_binding(plan.index, coordinate)))
        for file, coordinate in sorted(plan.files.items())
    }
    for group, name, main, pieces, model_param in plan.params:
        keys = None
        assembled: dict[str, torch.Tensor] = {}
        for source, copy in pieces:
            found = files[source.file].get(source.name, {})
            if keys is None:
                keys = sorted(found)
            if sorted(found) != keys or MASTER_KEY not in found:
                raise ValueError(f"{source.file}: {source.name} holds {sorted(found)}, expected {keys} with a master")
            for key, tensor in found.items():
                if tensor.dim() == 0:
                    if assembled.setdefault(key, tensor.clone()).item() != tensor.item():
                        raise ValueError(f"{source.file}: {source.name}.{key} differs between the saved blocks")
                    continue
                if not source.block.holds(tensor.shape):
                    raise ValueError(
                        f"{source.file}: {source.name}.{key} is {list(tensor.shape)}, not {list(source.block.shape)}"
                    )
                target = assembled.setdefault(key, torch.empty(main.numel(), dtype=tensor.dtype))
                target[copy.into : copy.into + copy.count] = tensor.reshape(-1)[copy.first : copy.first + copy.count]
        master = assembled.pop(MASTER_KEY).view(main.shape)
        saved_adapter = adapter(model_param) if adapter is not None else None
        if saved_adapter is not None:
            drawn = ", ".join(sorted({entry.file for entry, _ in pieces}))
            check_master(saved_adapter, master, f"{drawn} (optimizer child {plan.index})")
        state_tensors = {k: (v if v.dim() == 0 else v.view(main.shape)) for k, v in assembled.items()}
        try:
            out.params.append(
                (
                    group,
                    main,
                    *replicated._entry_tensors({MASTER_KEY: master, **state_tensors}, name, main, keys_wanted),
                )
            )
        except ValueError as exc:
            raise ValueError(f"optimizer child {plan.index}: {exc}") from None
    return out
