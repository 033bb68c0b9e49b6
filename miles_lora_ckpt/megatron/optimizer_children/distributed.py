"""The `distributed` family: megatron's DistributedOptimizer, masters and moments sharded over DP.

`DistributedOptimizer.state_dict()` leaves masters and moments out; megatron's own dp-zero helpers
hard-code two moments on 0.16 and silently drop state into an unallocated optimizer. This module
does the same bucket-space work over the *resolved* state keys instead, in separable steps so that
callers can put a consensus between any two of them:

    local_shards(child, keys)        this rank's contiguous shard of every bucket (may raise)
    gather_to_dp_root(child, shards) collectives only: the DP root receives the world tensors
    preflight_payload                checks a DP root's payload against this child (no mutation)
    split_for_scatter / scatter_from_dp_root / install_shards / check_installed   the reverse

Files: `optimizer/child{i}_{coordinate of the DP root}.safetensors` (bound to child i and that
model-parallel coordinate), written by each DP root, with world tensors keyed `buf{g}.{key}`: the concatenation of the unpadded part of every bucket of grad
buffer `g`. That layout does not depend on the DP size, so a DP=2 payload loads at DP=4 exactly
(`dp_elastic`). Param groups and the step travel as JSON (`child.state_dict()` of the DP root).
The gathers run over the child's gloo DP group: a child without one (gloo groups disabled, or the
scalar DistributedOptimizer megatron 0.19 builds beside a layout-based LayerWise) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.core.jsoncodec import from_json, to_json
from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY, Child, has_state
from miles_lora_ckpt.megatron.optimizer_children.family import (
    Collected,
    OptimizerFile,
    RankView,
    ReadContext,
    file_binding,
)
from miles_lora_ckpt.megatron.topology import Coordinates


def file_name(index: int, coordinate_key: str) -> str:
    """The file one DP root writes for child `index`: its model-parallel coordinate, never its rank."""
    return f"optimizer/child{index}_{coordinate_key}.safetensors"


def local_param_count(child) -> int:
    return sum(
        len(bucket["param_map"]) for maps in child.gbuf_ranges for buckets in maps.values() for bucket in buckets
    )


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class BucketLayout:
    """Where one bucket of one grad buffer lives, for this DP size."""

    buffer_index: int
    bucket_index: int
    world_numel: int  # padded, divisible by the DP size
    numel_unpadded: int

    def local_numel(self, dp_size: int) -> int:
        return self.world_numel // dp_size


def bucket_layouts(child) -> list[BucketLayout]:
    layouts = []
    for g, maps in enumerate(child.gbuf_ranges):
        if len(maps) != 1:
            raise ValueError(f"grad buffer {g} holds {len(maps)} dtypes; megatron supports one")
        for b, _ in enumerate(next(iter(maps.values()))):
            bucket = child.buffers[g].buckets[b]
            layouts.append(BucketLayout(g, b, bucket.grad_data.numel(), bucket.numel_unpadded))
    return layouts


def unpadded_numels(child) -> dict[str, list[int]]:
    """`{"buf{g}": [numel_unpadded of each bucket]}`: what a payload must match to load."""
    out: dict[str, list[int]] = {}
    for layout in bucket_layouts(child):
        out.setdefault(f"buf{layout.buffer_index}", []).append(layout.numel_unpadded)
    return out


def _param_maps(child, layout: BucketLayout) -> dict:
    maps = child.gbuf_ranges[layout.buffer_index]
    return next(iter(maps.values()))[layout.bucket_index]["param_map"]


def main_and_state(child, model_param) -> tuple[torch.Tensor, dict]:
    """The fp32 master shard of `model_param` held on this rank and its inner-optimizer state."""
    group_index, group_order = child.model_param_group_index_map[model_param]
    main_param = child.optimizer.param_groups[group_index]["params"][group_order]
    return main_param, child.optimizer.state.get(main_param, {})


def param_states(child) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """(model parameter, this rank's fp32 master shard, its state) for every parameter with a shard here."""
    return [(p, *main_and_state(child, p)) for p in child.model_param_group_index_map]


# --------------------------------------------------------------------------- save


def local_shards(child, keys: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
    """This rank's contiguous fp32 shard of every bucket, for the master and each state key."""
    dp_size = child.data_parallel_group_gloo.size()
    shards = []
    for layout in bucket_layouts(child):
        bucket = {k: torch.zeros(layout.local_numel(dp_size), dtype=torch.float32) for k in (MASTER_KEY, *keys)}
        for model_param, ranges in _param_maps(child, layout).items():
            main_param, state = main_and_state(child, model_param)
            start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
            bucket[MASTER_KEY][start:end].copy_(main_param.detach().view(-1))
            for key in keys:
                if key not in state:
                    raise KeyError(f"optimizer state of a parameter has no {key!r} (has {sorted(state)})")
                bucket[key][start:end].copy_(state[key].detach().view(-1))
        shards.append(bucket)
    return shards


def gather_to_dp_root(child, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Collective over the child's gloo DP group: the DP root gets `{"buf{g}.{key}": world tensor}`."""
    group = child.data_parallel_group_gloo
    dp_size, is_root = group.size(), group.rank() == 0
    root = dist.get_process_group_ranks(group)[0]
    pieces: dict[str, list[torch.Tensor]] = {}
    for layout, bucket in zip(bucket_layouts(child), shards, strict=True):
        for key, shard in bucket.items():
            received = [torch.empty_like(shard) for _ in range(dp_size)] if is_root else None
            dist.gather(shard, received, dst=root, group=group)
            if is_root:
                world = torch.cat(received)[: layout.numel_unpadded]
                pieces.setdefault(f"buf{layout.buffer_index}.{key}", []).append(world)
    return {name: torch.cat(parts) for name, parts in pieces.items()} if is_root else None


# --------------------------------------------------------------------------- load


def preflight_payload(child, keys: tuple[str, ...], payload: dict[str, torch.Tensor], saved_numels: dict) -> None:
    """Check a DP root's payload against this child without touching it; raises ValueError."""
    current = unpadded_numels(child)
    if saved_numels != current:
        raise ValueError(f"bucket layout differs: checkpoint {saved_numels}, this run {current}")
    expected = {f"{buf}.{key}" for buf in current for key in (MASTER_KEY, *keys)}
    if set(payload) != expected:
        missing, unexpected = sorted(expected - set(payload)), sorted(set(payload) - expected)
        raise ValueError(f"parameter state tensors differ: missing {missing}, unexpected {unexpected}")
    for name, tensor in payload.items():
        numel = sum(current[name.split(".")[0]])
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (numel,):
            raise ValueError(f"{name}: {tensor.dtype}{list(tensor.shape)}, expected torch.float32[{numel}]")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name}: holds NaN or Inf")


def split_for_scatter(child, keys: tuple[str, ...], payload: dict[str, torch.Tensor]) -> list[dict[str, list]]:
    """On the DP root: per bucket and key, the padded world tensor cut into one chunk per DP rank."""
    dp_size = child.data_parallel_group_gloo.size()
    offsets: dict[int, int] = {}
    plan = []
    for layout in bucket_layouts(child):
        start = offsets.get(layout.buffer_index, 0)
        offsets[layout.buffer_index] = start + layout.numel_unpadded
        chunks = {}
        for key in (MASTER_KEY, *keys):
            world = torch.zeros(layout.world_numel, dtype=torch.float32)
            world[: layout.numel_unpadded] = payload[f"buf{layout.buffer_index}.{key}"][
                start : start + layout.numel_unpadded
            ]
            chunks[key] = list(world.chunk(dp_size))
        plan.append(chunks)
    return plan


def scatter_from_dp_root(
    child, keys: tuple[str, ...], plan: list[dict[str, list]] | None
) -> list[dict[str, torch.Tensor]]:
    """Collective over the child's gloo DP group: every rank receives its shard of every bucket."""
    group = child.data_parallel_group_gloo
    dp_size = group.size()
    root = dist.get_process_group_ranks(group)[0]
    received = []
    for index, layout in enumerate(bucket_layouts(child)):
        bucket = {}
        for key in (MASTER_KEY, *keys):
            shard = torch.empty(layout.local_numel(dp_size), dtype=torch.float32)
            dist.scatter(shard, plan[index][key] if plan is not None else None, src=root, group=group)
            bucket[key] = shard
        received.append(bucket)
    return received


def install_shards(child, keys: tuple[str, ...], shards: list[dict[str, torch.Tensor]]) -> None:
    """Copy received shards into the masters and the (already allocated) optimizer state."""
    with torch.no_grad():
        for layout, bucket in zip(bucket_layouts(child), shards, strict=True):
            for model_param, ranges in _param_maps(child, layout).items():
                main_param, state = main_and_state(child, model_param)
                start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                main_param.view(-1).copy_(bucket[MASTER_KEY][start:end])
                for key in keys:
                    if key not in state:
                        raise KeyError(f"optimizer state was not allocated for {key!r}")
                    state[key].view(-1).copy_(bucket[key][start:end])


def check_installed(child, keys: tuple[str, ...], shards: list[dict[str, torch.Tensor]]) -> None:
    """Read back every master and state tensor and compare bit for bit with what was received.

    megatron's own dp-zero loader can drop moments silently; this is the check that it did not
    happen here.
    """
    for layout, bucket in zip(bucket_layouts(child), shards, strict=True):
        for model_param, ranges in _param_maps(child, layout).items():
            main_param, state = main_and_state(child, model_param)
            start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
            for key, tensor in [(MASTER_KEY, main_param), *[(k, state.get(k)) for k in keys]]:
                if tensor is None or not torch.equal(tensor.detach().view(-1), bucket[key][start:end]):
                    raise ValueError(f"optimizer state {key!r} did not arrive intact for a parameter")


# --------------------------------------------------------------------------- the family


@dataclass
class _Restore:
    keys: tuple[str, ...]
    state: dict  # the DP root's `state_dict()` as JSON: param groups and step
    payload: dict | None  # world tensors, on the DP root only


class DistributedFamily:
    """`ChildFamily` for DistributedOptimizer children (see the module docstring)."""

    name = "distributed"
    dp_elastic = True  # world tensors are laid out independently of the DP size

    def describe(self, child: Child, coords: Coordinates, names: dict, saving: bool) -> dict:
        opt = child.optimizer
        group = opt.data_parallel_group_gloo  # None with gloo groups disabled: refused when needed
        root = (dist.get_process_group_ranks(group)[0] if dist.is_initialized() else 0) if group is not None else None
        return {
            "params": sorted(names[id(p)] for p in opt.model_param_group_index_map),
            "dp_rank": group.rank() if group is not None else None,
            "dp_root": root,
            "numel_unpadded": unpadded_numels(opt),
        }

    def plan(self, index: int, described: list[dict | None], ranks: list[Coordinates]) -> dict:
        numels = {ranks[r].model_parallel_key: d["numel_unpadded"] for r, d in enumerate(described) if d is not None}
        return {"numel_unpadded": numels}

    def collect(self, child: Child, view: RankView, plan: dict, keys: tuple[str, ...]) -> Collected:
        opt = child.optimizer
        group = _gloo_group(child)
        if local_param_count(opt) > 0 and not has_state(opt):
            raise ValueError(f"optimizer child {child.index} has stepped on other ranks but has no state here")
        collected = Collected(local_shards(opt, keys))
        if group.rank() == 0:
            collected.state_key = f"{child.index}:{view.coords.model_parallel_key}"
            collected.state = to_json(opt.state_dict(), f"optimizer child {child.index}")
        return collected

    def exchange_for_save(
        self, child: Child, view: RankView, plan: dict, collected: Collected
    ) -> dict[str, OptimizerFile]:
        world = gather_to_dp_root(child.optimizer, collected.local)
        if world is None:
            return {}
        key = view.coords.model_parallel_key
        return {file_name(child.index, key): OptimizerFile(file_binding(child.index, key), world)}

    def files_to_read(self, index: int, view: RankView, described: list, plan: dict) -> list[str]:
        mine = described[view.rank]
        if mine["dp_rank"] is None:
            raise IncompatibleCheckpoint(
                f"optimizer child {index} has no gloo DP group: drop --disable-gloo-process-groups"
            )
        return [file_name(index, view.coords.model_parallel_key)] if mine["dp_rank"] == 0 else []

    def preflight(self, child: Child, view: RankView, described: list, plan: dict, read: ReadContext) -> _Restore:
        mine = described[view.rank]
        root_key = view.ranks[mine["dp_root"]].model_parallel_key
        state = read.states.get(f"{child.index}:{root_key}")
        if state is None:
            raise ValueError(f"the training state holds no optimizer state for child {child.index} at {root_key}")
        restore = _Restore(read.keys, state, None)
        if mine["dp_rank"] == 0:
            key = view.coords.model_parallel_key
            file = file_name(child.index, key)
            payload = read.tensors(file, file_binding(child.index, key))
            try:
                preflight_payload(child.optimizer, read.keys, payload, plan["numel_unpadded"].get(root_key))
            except ValueError as exc:
                raise ValueError(f"{file}: {exc}") from None
            restore.payload = payload
        return restore

    def allocate(self, child: Child, restore: _Restore) -> None:
        opt = child.optimizer
        had = {id(p): set(s) for p, s in opt.optimizer.state.items()}
        opt.load_state_dict(from_json(restore.state))  # param groups, step; allocates the moments
        _drop_planted_keys(opt, restore.keys, had)

    def exchange_for_load(self, child: Child, view: RankView, restore: _Restore) -> list:
        opt = child.optimizer
        split = split_for_scatter(opt, restore.keys, restore.payload) if restore.payload is not None else None
        return scatter_from_dp_root(opt, restore.keys, split)

    def install(self, child: Child, restore: _Restore, received: list) -> None:
        install_shards(child.optimizer, restore.keys, received)
        check_installed(child.optimizer, restore.keys, received)


def _gloo_group(child: Child):
    group = child.optimizer.data_parallel_group_gloo
    if group is None:
        raise ValueError(
            f"optimizer child {child.index} (DistributedOptimizer) has no gloo DP group: drop "
            "--disable-gloo-process-groups (megatron 0.19 also builds one without it beside a LayerWise "
            "optimizer when DDP uses the distributed optimizer; build DDP without it for layer-wise Muon)"
        )
    return group


def _drop_planted_keys(child, keys: tuple[str, ...], had: dict) -> None:
    # megatron 0.16's load_state_dict plants an uninitialised `exp_avg_sq` even for one-moment
    # optimizers; keep only what the optimizer really uses (and what it had before).
    for main_param, state in child.optimizer.state.items():
        for key in [k for k in state if k not in keys and k != "step" and k not in had.get(id(main_param), ())]:
            del state[key]


FAMILY = DistributedFamily()
