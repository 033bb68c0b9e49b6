"""Parameter state of megatron's DistributedOptimizer children: fp32 masters and every moment.

`DistributedOptimizer.state_dict()` leaves masters and moments out; megatron's own dp-zero helpers
hard-code two moments on 0.16 and silently drop state into an unallocated optimizer. This module
does the same bucket-space work over the *resolved* state keys instead, in three separable steps
so that callers can put a consensus between any two of them:

    local_shards(child, keys)        this rank's contiguous shard of every bucket (may raise)
    gather_to_dp_root(child, shards) collectives only: the DP root receives the world tensors
    ...
    split_for_scatter / scatter_from_dp_root / install_shards   the reverse, for loading

World tensors are keyed `buf{g}.{key}`: the concatenation of the unpadded part of every bucket of
grad buffer `g`. That layout does not depend on the DP size, so a DP=2 payload loads at DP=4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MASTER_KEY = "param"
# What megatron itself maps optimizer names to (0.19's `optimizer_state_keys`), for 0.16 and
# for optimizers that have no state yet. Anything not listed keeps Adam's pair, as megatron does.
_KEYS_BY_OPTIMIZER_NAME = {"lion": ("exp_avg",), "sgd": ("momentum_buffer",)}
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


# --------------------------------------------------------------------------- children


def optimizer_children(optimizer) -> list:
    """The children of a ChainedOptimizer (or the optimizer itself), stubs included, in order."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_stub(child) -> bool:
    """A child with no parameters on this rank: megatron builds it with `optimizer=None`."""
    return bool(getattr(child, "is_stub_optimizer", False)) or getattr(child, "optimizer", None) is None


# --------------------------------------------------------------------------- state keys


def resolve_state_keys(child) -> tuple[str, ...]:
    """The tensor state keys this child's optimizer keeps per parameter (never the master).

    Megatron's `optimizer_state_keys` (0.19+) where the class has it; otherwise the keys the inner
    optimizer really holds; for an optimizer that has not stepped yet, the keys its config names.
    Raises when megatron's answer and the real state disagree (state would be lost silently).
    """
    actual = _actual_state_keys(child)
    if isinstance(getattr(type(child), "optimizer_state_keys", None), property):
        declared = tuple(child.optimizer_state_keys)
        if actual and set(actual) != set(declared):
            raise ValueError(
                f"optimizer state holds {sorted(actual)} but megatron's optimizer_state_keys says "
                f"{list(declared)}: refusing to checkpoint a subset of the state"
            )
        return declared
    if actual:
        return actual
    return _keys_from_config(child.config)


def _keys_from_config(config) -> tuple[str, ...]:
    name = getattr(config, "optimizer", "adam")
    if name in ("muon", "adaptive_muon"):
        name = getattr(config, "muon_scalar_optimizer", "adam")
    return _KEYS_BY_OPTIMIZER_NAME.get(name, _ADAM_KEYS)


def _actual_state_keys(child) -> tuple[str, ...]:
    """Per-element tensor state keys of the inner optimizer (`step` and scalars excluded)."""
    inner = child.optimizer
    for group in inner.param_groups:
        for main_param in group["params"]:
            state = inner.state.get(main_param)
            if state:
                return tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == main_param.shape)
    return ()


def has_state(child) -> bool:
    """Whether this rank's inner optimizer has allocated per-parameter state (it has stepped)."""
    return bool(child.optimizer.state)


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
