"""Stock Miles' multi-LoRA slot primitives shared by both shapes (v1 and v2), defects included.

Bridge's slot helpers as the stand-in has them (no Megatron-Bridge here). `load_adapter` copies a
saved state into a slot by slot-independent name and returns how many tensors it copied.
`init_adapter_slot` sets the slot's scale; for a slot that loaded nothing, it draws the adapter's
initial weights, a function of the adapter's name (`sim.multi_lora_model.init_adapter_weights`).
`zero_optimizer_state_for_adapter` is v1's: the slot's groups' step and its params' exp_avg,
exp_avg_sq and step set to zero, masters left as they are. Collectives use tensors (Miles uses
`all_gather_object` / `broadcast_object_list`; the stand-in never pickles).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from miles_lora_ckpt_harness.sim import multi_lora_model as slots

_shard_topology = None  # cached for the life of the process, as Miles does


def megatron_shard_name(tp_rank: int, pp_rank: int, ep_rank: int, ep_size: int) -> str:
    suffix = f"_ep{ep_rank}" if ep_size > 1 else ""
    return f"adapter_megatron_tp{tp_rank}_pp{pp_rank}{suffix}.pt"


def my_coords() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def adapter_shard_topology() -> tuple[bool, tuple[tuple[int, int, int], ...]]:
    """Collective on the first call: (is this rank the writer of its (tp, pp, ep), realized coords)."""
    global _shard_topology
    if _shard_topology is not None:
        return _shard_topology
    coords = my_coords()
    if not dist.is_initialized():
        _shard_topology = (True, (coords,))
        return _shard_topology
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor(coords, dtype=torch.int64))
    every = [tuple(int(v) for v in t.tolist()) for t in gathered]
    writer = every.index(coords) == dist.get_rank()
    _shard_topology = (writer, tuple(sorted(set(every))))
    return _shard_topology


def ep_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size()


def slot_state(model, slot: int) -> dict[str, torch.Tensor]:
    """What Bridge's `expose_adapter_slot` lets the shard writer save: the slot's adapter, slot-independent names."""
    return {
        slots.slot_independent_name(name): param.data.cpu()
        for name, param in slots.slot_parameters(model, slot).items()
        if ".adapter." in name
    }


def load_adapter(model, slot: int, state: dict) -> int:
    loaded = 0
    with torch.no_grad():
        for name, param in slots.slot_parameters(model, slot).items():
            saved = state.get(slots.slot_independent_name(name))
            if saved is not None:
                param.data.copy_(saved.to(param.dtype))
                loaded += 1
    return loaded


def init_adapter_slot(model, slot: int, adapter_name: str, rank: int, alpha: float, *, fresh: bool) -> None:
    if fresh:
        slots.init_adapter_weights(model, slot, adapter_name)
    for linear in slots.multi_lora_linears(model):
        linear.scales[slot] = alpha / rank


def zero_optimizer_state_for_adapter(optimizer, model, idx: int) -> None:
    """Miles v1's reset: zero the slot's group steps and its params' moments and steps; masters
    untouched."""
    targets = set()
    for param in slots.slot_parameters(model, idx).values():
        main = getattr(param, "main_param", None)
        targets.add(id(param if main is None else main))
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(child, "optimizer", None)
        if inner is None:
            continue
        main_of = {}
        for model_group, main_group in zip(
            getattr(child, "float16_groups", []), getattr(child, "fp32_from_float16_groups", []), strict=False
        ):
            for model_param, main_param in zip(model_group, main_group, strict=False):
                main_of[id(main_param)] = id(model_param)
        for group in inner.param_groups:
            if group.get("miles_multi_lora_slot") == idx and "step" in group:
                if torch.is_tensor(group["step"]):
                    group["step"].zero_()
                else:
                    group["step"] = 0
        for param, state in inner.state.items():
            if id(param) in targets or main_of.get(id(param)) in targets:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key].zero_()
                if "step" in state:
                    if torch.is_tensor(state["step"]):
                        state["step"].zero_()
                    else:
                        state["step"] = 0


def broadcast_json(value, src: int = 0):
    """Rank `src`'s JSON-able value on every rank (Miles: broadcast_object_list)."""
    if not dist.is_initialized():
        return value
    data = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if dist.get_rank() == src:
        buf[:] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, src)
    return json.loads(bytes(buf.tolist()).decode())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
