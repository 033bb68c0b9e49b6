"""The global view of a harness run's trainable state, for layout-independent bit comparisons.

`global_view` assembles, from every rank's part, each adapter weight, fp32 master and moment as the
global tensor megatron's `sharded_state_dict` describes (`megatron.param_blocks`). It digests the
raw bits. Per-parameter steps and each optimizer child's param groups are merged over the ranks. Two
runs at different TP / PP / VPP / EP / DP layouts holding the same global state give the same
digests. Used by the demo's resharding resume (`demo.reshard`) and the resharding tests
(`tests/test_reshard.py`).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from miles_lora_ckpt.core.consensus import Consensus, Outcome
from miles_lora_ckpt.core.global_layout import Block, global_indices
from miles_lora_ckpt.core.jsoncodec import to_json
from miles_lora_ckpt.megatron import adapter_shards, param_blocks
from miles_lora_ckpt.megatron.optimizer_children import chain, distributed, family_of, leaf_children

SENTINEL = 2**40  # no bit pattern of a float32 / bfloat16 widened to int64 reaches it


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor as int64 (bf16 / fp32)."""
    flat = tensor.detach().contiguous().view(-1)
    return flat.view(torch.int16 if flat.element_size() == 2 else torch.int32).to(torch.int64)


def _contributions(run) -> tuple[dict, dict]:
    """This rank's parts of every global tensor: `{key: (global shape, [(indices, bits)])}`, and the
    JSON state: per-parameter steps and each child's param groups (without their param lists)."""
    blocks = {n: Block.from_dict(b, n) for n, b in param_blocks.describe(run.model).items() if b is not None}
    parts: dict[str, tuple] = {}

    def add(key, block, first, stop, tensor):
        entry = parts.setdefault(key, (list(block.global_shape), []))
        entry[1].append((global_indices(block, first, stop), _bits(tensor)))

    for name, param in adapter_shards.adapter_params(run.model).items():
        block = blocks[name]
        add(f"adapter:{block.name}", block, 0, block.numel, param)
    names = chain.param_names(run.model)
    states: dict[str, object] = {}
    for child in leaf_children(run.optimizer):
        if child.is_stub:
            continue
        opt = child.optimizer
        # megatron's own view of the param groups: a DistributedOptimizer's state_dict() (it moves the
        # step into the groups, as its load_state_dict leaves it there); the inner groups otherwise
        is_distributed = family_of(child) is distributed.FAMILY
        if is_distributed:
            groups = to_json(opt.state_dict(), "state")["optimizer"]["param_groups"]
        else:
            groups = opt.optimizer.param_groups
        groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        states[f"groups:{child.index}"] = to_json(groups, "groups")
        if is_distributed:
            held = [
                (model_param, *distributed.main_and_state(opt, model_param), ranges["param"].start, ranges["param"].end)
                for layout in distributed.bucket_layouts(opt)
                for model_param, ranges in distributed._param_maps(opt, layout).items()
            ]
        else:  # whole parameters (Float16 / FP32, layer-wise)
            held = [(p, main, state, 0, p.numel()) for p, main, state in chain.param_states(child)]
        for model_param, main, state, first, stop in held:
            block = blocks[names[id(model_param)]]
            add(f"master:{block.name}", block, first, stop, main)
            for key, value in sorted(state.items()):
                if key == "step" or value.dim() == 0:
                    states[f"{key}:{block.name}"] = float(value)
                else:
                    add(f"{key}:{block.name}", block, first, stop, value)
    return parts, states


def global_view(run, consensus: Consensus) -> dict:
    """Collective. `{key: digest of the global tensor's bits}` for every adapter weight, master and
    moment (every element given by some rank, replicas bit-identical), and the JSON states (steps,
    param groups) of every rank merged (replicas equal)."""
    parts, states = _contributions(run)
    shapes = consensus.agree("reshard-shapes", Outcome.success({k: v[0] for k, v in parts.items()}))
    everyone = {}
    for mine in shapes:
        everyone.update(mine)
    keys = sorted(everyone)
    sizes = [int(torch.tensor(everyone[k]).prod()) for k in keys]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    buffer = torch.full((sum(sizes),), SENTINEL, dtype=torch.int64)
    for key, offset in zip(keys, offsets, strict=True):
        for indices, bits in parts.get(key, (None, []))[1]:
            buffer[offset + indices] = bits
    gathered = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, buffer)
    stacked = torch.stack(gathered)
    held = stacked != SENTINEL
    merged = torch.where(held, stacked, torch.iinfo(torch.int64).min).max(dim=0).values
    low = torch.where(held, stacked, torch.iinfo(torch.int64).max).min(dim=0).values
    problems = []
    if not bool(held.any(dim=0).all()):
        problems.append("an element of a global tensor is held by no rank")
    if not bool((merged[held.any(dim=0)] == low[held.any(dim=0)]).all()):
        problems.append("replicas of a global tensor differ")
    digests = {}
    for key, offset, size in zip(keys, offsets, sizes, strict=True):
        digests[key] = hashlib.sha256(merged[offset : offset + size].numpy().tobytes()).hexdigest()[:32]
    all_states = consensus.agree("reshard-states", Outcome.success(states))
    merged_states: dict = {}
    for rank_states in all_states:
        for key, value in rank_states.items():
            if merged_states.setdefault(key, value) != value:
                problems.append(f"ranks disagree on {key}")
    for key, value in merged_states.items():
        digests[key] = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]
    return {"digests": digests, "problems": problems, "states": merged_states}


def first_difference(a: dict, b: dict) -> str | None:
    """The first key (sorted) whose digest differs between two global views' digests, or None."""
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key
    return None
