"""The `replicated` family: Float16OptimizerWithFloat16Params and FP32Optimizer children.

megatron builds these wherever the distributed optimizer is off: Muon and its scalar optimizer
without layer-wise sharding, megatron 0.19's own Lion, any optimizer with
`--no-use-distributed-optimizer`. Each child steps whole parameters; with DDP all-reducing the
gradients, every DP rank holds the same masters and moments. The same per-parameter format serves
the `layer-wise` family (layer_wise.py), where each parameter lives on one DP rank only.

One *entry* per parameter shard, named `{slice}:{name}`: `slice` is the model-parallel coordinate of
the shard (`tp000_pp000` dense, `pp000_ep000_etp000` expert), `name` the chunk-qualified parameter
name (`chunk0.layers.0.linear_qkv.lora_A.weight`). An entry holds

    {name}.param     the fp32 master (a Float16 child's fp32 copy; an FP32 child's parameter itself)
    {name}.{key}     every tensor the inner optimizer keeps for it: the per-element state keys
                     (`exp_avg`, `exp_avg_sq`, `momentum_buffer`) and 0-d ones such as AdamW's `step`

The lowest rank holding an entry writes it, into
`optimizer/child{i}_tp000_pp000_ep000_etp000_dp000_cp000.safetensors`, named by the writer's
parallel coordinate (model-parallel key, DP and CP rank), never by its global rank, and bound to
child i and that coordinate. The plan in the manifest (`core.child_layouts.WholeParamLayout`) maps
every entry to its file and param group (and every file to its coordinate), so a loader at any DP
size reads exactly the entries it holds. Param groups (hyperparameters, never parameter lists) and
the grad scaler are JSON, one record per model-parallel coordinate.

Before saving, every rank digests its replica: replicas that differ (a DDP that reduce-scatters
for a distributed optimizer while megatron built non-distributed children, say) are refused rather
than one of them silently kept. A DP-size change restores exactly (`dp_elastic`): the state of a
whole parameter does not depend on how many replicas hold it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from miles_lora_ckpt.core.child_layouts import WholeParamEntry, WholeParamLayout
from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.core.global_layout import Block, distinct, plan_copies
from miles_lora_ckpt.core.jsoncodec import from_json, to_json
from miles_lora_ckpt.megatron.adapter_shards import is_expert
from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY, Child
from miles_lora_ckpt.megatron.optimizer_children.family import (
    ChildDescription,
    Collected,
    OptimizerFile,
    RankView,
    ReadContext,
    ReshardContext,
    SavedChild,
    file_binding,
    saved_state_at,
)
from miles_lora_ckpt.megatron.optimizer_children.masters import check_master
from miles_lora_ckpt.megatron.topology import Coordinates

__all__ = [
    "FAMILY",
    "WholeParameterFamily",
    "WholeParameterHeld",
    "entry_name",
    "param_states",
]


@dataclass(frozen=True)
class WholeParameterHeld:
    """What one rank holds of a whole-parameter child (`WholeParameterFamily.describe`)."""

    params: tuple[str, ...]  # the names of the parameters it steps, sorted
    entries: dict[str, int]  # `{entry name: its param group}` of every parameter shard it steps
    groups: int  # how many param groups the child has
    replica_digest: str | None  # the digest of its masters and moments (a replicated save only)

    def to_json(self) -> dict:
        """Its fields as JSON, under the keys the plan always had."""
        return {
            "params": list(self.params),
            "entries": {entry: {"group": group} for entry, group in self.entries.items()},
            "groups": self.groups,
            "replica_digest": self.replica_digest,
        }

    @classmethod
    def parse(cls, data: dict) -> WholeParameterHeld:
        """From `to_json`'s keys (in a `ChildDescription`'s payload)."""
        entries = {entry: held["group"] for entry, held in data["entries"].items()}
        return cls(tuple(data["params"]), entries, data["groups"], data.get("replica_digest"))


def file_coordinate(coords: Coordinates) -> str:
    """A writer's parallel coordinate (`tp000_pp000_ep000_etp000_dp000_cp000`), never its global rank."""
    return f"{coords.model_parallel_key}_dp{coords.dp:03d}_cp{coords.cp:03d}"


def file_name(index: int, coords: Coordinates) -> str:
    """The file one rank writes for child `index`, named by its coordinate (`file_coordinate`)."""
    return f"optimizer/child{index}_{file_coordinate(coords)}.safetensors"


def param_states(child) -> list[tuple[int, torch.Tensor, torch.Tensor, dict]]:
    """(param group, model parameter, fp32 master, inner-optimizer state) of every parameter stepped here."""
    to_model = {}
    for model_group, main_group in zip(
        getattr(child, "float16_groups", []), getattr(child, "fp32_from_float16_groups", []), strict=True
    ):
        to_model.update({id(main): model for model, main in zip(model_group, main_group, strict=True)})
    inner = child.optimizer
    return [
        (g, to_model.get(id(main), main), main, inner.state.get(main, {}))
        for g, group in enumerate(inner.param_groups)
        for main in group["params"]
    ]


def entry_name(coords: Coordinates, model_param, name: str) -> str:
    return f"{coords.expert_key if is_expert(model_param) else coords.dense_key}:{name}"


def _tensor_keys(state: dict) -> list[str]:
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))


@dataclass
class _Restore:
    groups: list[dict]  # hyperparameters per param group (no parameter lists)
    grad_scaler: dict | None
    params: list[tuple[int, torch.Tensor, torch.Tensor, dict]] = field(
        default_factory=list
    )  # group, main, master, state


@dataclass(frozen=True)
class _SavedEntry:
    """One saved entry a resharding load draws from: its file, its name there, its block."""

    file: str
    name: str  # chunk-qualified name in that file
    block: Block
    group: int
    coordinate: str  # the saved model-parallel coordinate it belongs to (param groups are recorded there)


@dataclass(frozen=True)
class WholeReshard:
    """`WholeParameterFamily.plan_reshard`'s plan of one child on this rank."""

    keys: tuple[str, ...]
    writers: dict[str, str]  # file -> its writer's coordinate (binding)
    params: tuple  # per parameter (group, name, master, ((_SavedEntry, copy), ...), model parameter)
    coordinates: tuple[str, ...]  # the saved coordinates drawn from (their param groups must agree)

    @property
    def files(self) -> tuple[str, ...]:
        """The files read whole."""
        return tuple(sorted(self.writers))


def _coordinate_of(shard: str, name: str, saved: dict) -> str | None:
    """The saved model-parallel coordinate (`tp000_pp000_ep000_etp000`) of an entry's shard key
    (`tp000_pp000` dense, `pp000_ep000_etp000` expert) that describes `name`."""
    for coordinate in sorted(saved):
        tp, pp, ep, etp = coordinate.split("_")
        if shard in (f"{tp}_{pp}", f"{pp}_{ep}_{etp}") and saved[coordinate].get(name) is not None:
            return coordinate
    return None


class WholeParameterFamily:
    """`ChildFamily` for children that step whole parameters; `replicated` or `layer-wise` placement."""

    dp_elastic = True  # the state of a whole parameter does not depend on the DP size

    def __init__(self, kind: FamilyKind):
        self.kind = kind

    @property
    def replicated(self) -> bool:
        """Every DP rank holds every entry (`replicated`); else exactly one rank does (`layer-wise`)."""
        return self.kind is FamilyKind.REPLICATED

    # ------------------------------------------------------------------- save

    def describe(self, child: Child, coords: Coordinates, names: dict, saving: bool) -> WholeParameterHeld:
        entries, digest = {}, hashlib.blake2b(digest_size=16)
        for group, model_param, main, state in param_states(child.optimizer):
            if id(model_param) not in names:
                raise ValueError(f"optimizer child {child.index} steps a tensor that is not a model parameter")
            entry = entry_name(coords, model_param, names[id(model_param)])
            entries[entry] = group
            if saving and self.replicated:
                for tensor in [main, *(state[k] for k in _tensor_keys(state))]:
                    digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return WholeParameterHeld(
            params=tuple(sorted(e.split(":", 1)[1] for e in entries)),
            entries=entries,
            groups=len(child.optimizer.param_groups),
            replica_digest=digest.hexdigest() if saving and self.replicated else None,
        )

    def parse_held(self, data: dict) -> WholeParameterHeld:
        return WholeParameterHeld.parse(data)

    def plan(self, index: int, described: list[ChildDescription | None], ranks: list[Coordinates]) -> WholeParamLayout:
        holders: dict[str, list[int]] = {}
        for rank, desc in enumerate(described):
            for entry in desc.held.entries if desc is not None else {}:
                holders.setdefault(entry, []).append(rank)
        if not self.replicated:
            shared = {e: r for e, r in holders.items() if len(r) > 1}
            if shared:
                entry, owners = next(iter(sorted(shared.items())))
                raise ValueError(
                    f"optimizer child {index}: {entry} is held by ranks {owners} under a LayerWiseDistributedOptimizer, "
                    "which gives every parameter one owner"
                )
        entries, files = {}, {}
        for entry, owners in sorted(holders.items()):
            writer = owners[0]
            entries[entry] = WholeParamEntry(file_name(index, ranks[writer]), described[writer].held.entries[entry])
            files[entries[entry].file] = file_coordinate(ranks[writer])
        self.check_replicas(index, described)
        reporters: dict[str, int] = {}
        for rank, desc in enumerate(described):
            if desc is not None:
                reporters.setdefault(ranks[rank].model_parallel_key, rank)
        return WholeParamLayout(entries, files, reporters)

    def collect(self, child: Child, view: RankView, plan: WholeParamLayout, keys: tuple[str, ...]) -> Collected:
        opt, coords = child.optimizer, view.coords
        mine = file_name(child.index, coords)
        tensors: dict[str, torch.Tensor] = {}
        for _, model_param, main, state in param_states(opt):
            name = view.names[id(model_param)]
            entry = entry_name(coords, model_param, name)
            missing = [k for k in keys if k not in state]
            if missing:
                raise ValueError(
                    f"optimizer child {child.index}: {entry} has no {missing} (has {_tensor_keys(state)}); "
                    "the child stepped elsewhere, this parameter never did"
                )
            if plan.entries[entry].file != mine:
                continue
            tensors[f"{name}.{MASTER_KEY}"] = main.detach().to("cpu", copy=True)
            for key in _tensor_keys(state):
                tensors[f"{name}.{key}"] = state[key].detach().to("cpu", copy=True)
        collected = Collected(tensors)
        if (plan.state_reporters or {}).get(coords.model_parallel_key) == view.rank:
            collected.state_key = f"{child.index}:{coords.model_parallel_key}"
            collected.state = {
                "param_groups": [
                    to_json({k: v for k, v in g.items() if k != "params"}, f"optimizer child {child.index} group {i}")
                    for i, g in enumerate(opt.optimizer.param_groups)
                ],
                "grad_scaler": _grad_scaler_state(opt, child.index),
            }
        return collected

    def check_replicas(self, index: int, described: list[ChildDescription | None]) -> None:
        """Ranks that hold the same entries must hold the same bytes (replicated placement only)."""
        if not self.replicated:
            return
        first: dict[tuple, tuple[int, str]] = {}
        for rank, desc in enumerate(described):
            if desc is None or desc.held.replica_digest is None:
                continue
            held = tuple(sorted(desc.held.entries))
            seen = first.setdefault(held, (rank, desc.held.replica_digest))
            if seen[1] != desc.held.replica_digest:
                raise ValueError(
                    f"optimizer child {index}: the replicas on ranks {seen[0]} and {rank} hold different masters or "
                    "moments; a non-distributed optimizer needs DDP to all-reduce gradients (is DDP built with "
                    "use_distributed_optimizer for a Float16/FP32 optimizer?)"
                )

    def exchange_for_save(
        self, child: Child, view: RankView, plan: WholeParamLayout, collected: Collected
    ) -> dict[str, OptimizerFile]:
        if not collected.local:
            return {}
        binding = file_binding(child.index, file_coordinate(view.coords))
        return {file_name(child.index, view.coords): OptimizerFile(binding, collected.local)}

    # ------------------------------------------------------------------- load

    def files_to_read(self, index: int, view: RankView, described: list, plan: WholeParamLayout) -> list[str]:
        self._check_coverage(index, described, plan)
        files = set()
        for entry in described[view.rank].held.entries:
            if entry not in plan.entries:
                raise IncompatibleCheckpoint(f"optimizer child {index}: the checkpoint holds no state for {entry}")
            files.add(plan.entries[entry].file)
        unbound = sorted(f for f in files if f not in plan.files)
        if unbound:
            raise ValueError(f"optimizer child {index}: the plan names no coordinate for {unbound[0]}")
        return sorted(files)

    def _check_coverage(self, index: int, described: list, plan: WholeParamLayout) -> None:
        held = {e for desc in described if desc is not None for e in desc.held.entries}
        saved = set(plan.entries)
        if held != saved:
            extra, missing = sorted(saved - held), sorted(held - saved)
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: the checkpoint holds state for parameters this run does not step "
                f"({extra[:3]}) or lacks some it does ({missing[:3]})"
            )

    def preflight(
        self, child: Child, view: RankView, described: list, plan: WholeParamLayout, read: ReadContext
    ) -> _Restore:
        opt, coords = child.optimizer, view.coords
        state = read.states.get(f"{child.index}:{coords.model_parallel_key}")
        if state is None:
            raise ValueError(
                f"the training state holds no optimizer state for child {child.index} at {coords.model_parallel_key}"
            )
        groups = [from_json(g) for g in state["param_groups"]]
        # unknown keys refused, differences from the launch reported and settled (core.hyperparameters)
        where = f"optimizer child {child.index} at {coords.model_parallel_key}"
        read.hyperparameters.param_groups(where, groups, opt.optimizer.param_groups)
        restore = _Restore(groups, state.get("grad_scaler"))
        files: dict[str, dict] = {}
        for group, model_param, main, _ in param_states(opt):
            name = view.names[id(model_param)]
            entry = entry_name(coords, model_param, name)
            saved = plan.entries[entry]
            if saved.group != group:
                raise ValueError(
                    f"optimizer child {child.index}: {entry} is in param group {group}, the checkpoint has it in "
                    f"group {saved.group}"
                )
            if saved.file not in files:
                binding = file_binding(child.index, plan.files[saved.file])
                files[saved.file] = _by_parameter(read.tensors(saved.file, binding))
            try:
                found = dict(files[saved.file].get(name, {}))
                restore.params.append((group, main, *_entry_tensors(found, name, main, read.keys)))
            except ValueError as exc:
                raise ValueError(f"{saved.file}: {exc}") from None
            source = read.adapter(model_param) if read.adapter is not None else None
            if source is not None:  # the saved adapter must be this master's cast (masters.py)
                check_master(source, restore.params[-1][2], f"{saved.file} (optimizer child {child.index})")
        return restore

    # ------------------------------------------------------------------- resharding load

    def plan_reshard(self, child: Child, saved: SavedChild, layout: ReshardContext) -> WholeReshard:
        """This rank's parameters at another layout, each assembled like an adapter weight from the
        saved blocks of its global tensor (`core.global_layout.plan_copies`); the files drawn from
        are read whole."""
        index, recorded = child.index, saved.layout
        sources: dict[str, list[_SavedEntry]] = {}
        for entry, where in sorted(recorded.entries.items()):
            shard, _, name = entry.partition(":")
            # the block its writer's own coordinate records (that file's layout stamp binds those), else
            # the first coordinate of its shard that describes it
            own = "_".join(recorded.files.get(where.file, "").split("_")[:4])
            coordinate = (
                own if layout.saved.get(own, {}).get(name) is not None else _coordinate_of(shard, name, layout.saved)
            )
            if coordinate is None:
                raise ValueError(f"optimizer child {index}: the global layout has no block for {entry}")
            block = layout.saved[coordinate][name]
            sources.setdefault(block.name, []).append(_SavedEntry(where.file, name, block, where.group, coordinate))
        writers: dict[str, str] = {}
        params, used = [], set()
        # the copies this rank's own coordinate wrote first: at the saved layout it reads its own files
        mine = None if layout.view is None else layout.view.coords.model_parallel_key
        for group, model_param, main, _ in param_states(child.optimizer):
            name = layout.names[id(model_param)]
            block = layout.block_of(name)
            found = sorted(sources.get(block.name, []), key=lambda s: s.coordinate != mine)
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
                writers[source.file] = recorded.files[source.file]
                used.add(source.coordinate)
            params.append((group, name, main, tuple(pieces), model_param))
        if not used and mine is not None:  # no parameter here (a layer-wise child): its own coordinate's state
            used.add(mine)
        return WholeReshard(saved.keys, writers, tuple(params), tuple(sorted(used)))

    def restore_resharded(self, child: Child, plan: WholeReshard, read: ReadContext) -> _Restore:
        """Read the files (binding checked) and assemble every parameter's master and state: every
        per-element key element by element; a 0-d state (a torch optimizer's `step`) must be the
        same in every saved block it draws from."""
        index = child.index
        state = saved_state_at(index, plan.coordinates, read.states)
        groups = [from_json(g) for g in state["param_groups"]]
        current = child.optimizer.optimizer.param_groups
        if len(groups) != len(current):
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: the checkpoint has {len(groups)} param group(s), this run {len(current)}"
            )
        if read.hyperparameters is not None:
            read.hyperparameters.param_groups(f"optimizer child {index}", groups, current)
        out = _Restore(groups, state.get("grad_scaler"))
        files = {
            file: _by_parameter(read.tensors(file, file_binding(index, coordinate)))
            for file, coordinate in sorted(plan.writers.items())
        }
        for group, name, main, pieces, model_param in plan.params:
            keys = None
            assembled: dict[str, torch.Tensor] = {}
            # one saved block that is the whole parameter (the saved layout): its tensors as read,
            # no copy, as the same-layout preflight takes them
            whole = len(pieces) == 1 and (pieces[0][1].first, pieces[0][1].into) == (0, 0)
            whole = whole and pieces[0][1].count == main.numel()
            for source, copy in pieces:
                found = files[source.file].get(source.name, {})
                if keys is None:
                    keys = sorted(found)
                if sorted(found) != keys or MASTER_KEY not in found:
                    raise ValueError(
                        f"{source.file}: {source.name} holds {sorted(found)}, expected {keys} with a master"
                    )
                for key, tensor in found.items():
                    if tensor.dim() == 0:
                        if assembled.setdefault(key, tensor.clone()).item() != tensor.item():
                            raise ValueError(f"{source.file}: {source.name}.{key} differs between the saved blocks")
                        continue
                    if not source.block.holds(tensor.shape):
                        raise ValueError(
                            f"{source.file}: {source.name}.{key} is {list(tensor.shape)}, not {list(source.block.shape)}"
                        )
                    if whole and tensor.numel() == main.numel():
                        assembled[key] = tensor.reshape(-1)
                        continue
                    target = assembled.setdefault(key, torch.empty(main.numel(), dtype=tensor.dtype))
                    target[copy.into : copy.into + copy.count] = tensor.reshape(-1)[
                        copy.first : copy.first + copy.count
                    ]
            master = assembled.pop(MASTER_KEY).view(main.shape)
            saved_adapter = read.adapter(model_param) if read.adapter is not None else None
            if saved_adapter is not None:
                drawn = ", ".join(sorted({entry.file for entry, _ in pieces}))
                check_master(saved_adapter, master, f"{drawn} (optimizer child {index})")
            state_tensors = {k: (v if v.dim() == 0 else v.view(main.shape)) for k, v in assembled.items()}
            try:
                out.params.append(
                    (group, main, *_entry_tensors({MASTER_KEY: master, **state_tensors}, name, main, read.keys))
                )
            except ValueError as exc:
                raise ValueError(f"optimizer child {index}: {exc}") from None
        return out

    # ------------------------------------------------------------------- apply

    def allocate(self, child: Child, restore: _Restore) -> None:
        """Nothing to allocate: `install` gives each parameter its saved state."""

    def replaces(self, restore: _Restore) -> tuple[str, ...]:
        """Nothing: `install` writes the masters and the state in place."""
        return ()

    def install(self, child: Child, restore: _Restore) -> None:
        opt = child.optimizer
        inner = opt.optimizer
        with torch.no_grad():
            for group, main, master, state in restore.params:
                main.copy_(master)
                inner.state[main] = {
                    key: _placed(tensor, main, inner.param_groups[group]) for key, tensor in state.items()
                }
            for group, saved in zip(inner.param_groups, restore.groups, strict=True):
                group.update(saved)
        if restore.grad_scaler is not None and getattr(opt, "grad_scaler", None) is not None:
            opt.grad_scaler.load_state_dict(from_json(restore.grad_scaler))
        for _, main, master, state in restore.params:  # read back: nothing was dropped or aliased
            live = inner.state.get(main, {})
            if not _same(main, master) or set(live) != set(state):
                raise ValueError(f"optimizer child {child.index}: a master or its state keys did not arrive intact")
            for key, tensor in state.items():
                if not _same(live[key], tensor):
                    raise ValueError(f"optimizer child {child.index}: optimizer state {key!r} did not arrive intact")


def _by_parameter(tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    """`{name.key: tensor}` of one file as `{name: {key: tensor}}` (keys never hold a dot)."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for full, tensor in tensors.items():
        name, _, key = full.rpartition(".")
        grouped.setdefault(name, {})[key] = tensor
    return grouped


def _entry_tensors(found: dict, name: str, main: torch.Tensor, keys: tuple[str, ...]) -> tuple:
    """The master and state of one parameter (`{key: tensor}` from its file), checked against the live master."""
    master = found.pop(MASTER_KEY, None)
    if master is None:
        raise ValueError(f"no master {name}.{MASTER_KEY}")
    if master.dtype != main.dtype or master.shape != main.shape:
        raise ValueError(
            f"{name}.{MASTER_KEY} is {master.dtype}{list(master.shape)}, expected {main.dtype}{list(main.shape)}"
        )
    missing = [k for k in keys if k not in found]
    if missing:
        raise ValueError(f"{name}: missing state {missing} (has {sorted(found)})")
    for key, tensor in [(MASTER_KEY, master), *found.items()]:
        if tensor.dim() and tensor.shape != main.shape:
            raise ValueError(f"{name}.{key} has shape {list(tensor.shape)}, the parameter {list(main.shape)}")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ValueError(f"{name}.{key}: holds NaN or Inf")
    return master, found


def _placed(tensor: torch.Tensor, main: torch.Tensor, group: dict) -> torch.Tensor:
    # Per-element state lives with the parameter; 0-d state (a torch optimizer's `step`) on the CPU
    # unless the optimizer is capturable or fused, as torch allocates it.
    on_device = tensor.dim() > 0 or group.get("capturable") or group.get("fused")
    return tensor.to(device=main.device if on_device else "cpu", copy=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())


def _grad_scaler_state(child, index: int):
    scaler = getattr(child, "grad_scaler", None)
    return to_json(scaler.state_dict(), f"optimizer child {index} grad scaler") if scaler is not None else None


FAMILY = WholeParameterFamily(FamilyKind.REPLICATED)
