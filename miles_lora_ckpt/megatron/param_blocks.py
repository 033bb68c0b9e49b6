"""Each trainable parameter's place in the global model, from megatron's own layout knowledge.

For every trainable parameter of every model chunk (chunk-qualified name, as `adapter_shards`
names it) a `core.global_layout.Block`:

- the global name: the chunk prefix dropped and the chunk-local layer index replaced by the
  layer's global one, read from the layer module's `layer_number` (megatron's `TransformerLayer`
  numbers its layers globally from 1, across pipeline stages and virtual-pipeline chunks, from
  `get_transformer_layer_offset`), so `chunk1.decoder.layers.0.x` of stage 1 becomes
  `decoder.layers.6.x`;
- the global shape and this rank's offsets in it: from the owning module's `sharded_state_dict`
  (megatron's `ShardedTensor`: global shape, global offset; a column-parallel linear splits
  axis 0, a row-parallel one axis 1), or, for a module without one, the whole parameter (a
  replicated LoRA factor).

What cannot be described is None (the parameter is then refused by a resharding load, never
guessed): a parameter megatron marks tensor-parallel whose module gives no `ShardedTensor` for it,
one described by a `ShardedTensorFactory` (swiglu's fused `linear_fc1`: not resharded yet), or a
layer index without a `layer_number`.
"""

from __future__ import annotations

import re

import torch

from miles_lora_ckpt.core.global_layout import Block
from miles_lora_ckpt.megatron.adapter_shards import strip_wrappers

_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")


def describe(model) -> dict[str, dict | None]:
    """`{chunk-qualified name: Block.to_dict() or None}` of every trainable parameter (JSON)."""
    chunks = model if isinstance(model, list | tuple) else [model]
    out: dict[str, dict | None] = {}
    for index, chunk in enumerate(chunks):
        modules = {strip_wrappers(name): module for name, module in chunk.named_modules()}
        layers = _global_layer_prefixes(modules)
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            local = strip_wrappers(name)
            block = _block(local, param, modules, layers)
            out[f"chunk{index}.{local}"] = None if block is None else block.to_dict()
    return out


def _global_layer_prefixes(modules: dict) -> dict[str, str | None]:
    """`{"decoder.layers.0": "decoder.layers.6" (or None without a layer_number)}`."""
    prefixes = {}
    for name, module in modules.items():
        match = _LAYER.search(name)
        if match:
            number = getattr(module, "layer_number", None)
            ok = isinstance(number, int) and number >= 1
            prefixes[name] = f"{name[: match.start(2)]}{number - 1}" if ok else None
    return prefixes


def global_name(local: str, layers: dict[str, str | None]) -> str | None:
    """`local` with its (innermost) layer prefix made global; None where that layer has no number."""
    best = None
    for prefix in layers:
        if local.startswith(prefix + ".") and (best is None or len(prefix) > len(best)):
            best = prefix
    if best is None:
        return local
    replaced = layers[best]
    return None if replaced is None else replaced + local[len(best) :]


def _block(local: str, param: torch.nn.Parameter, modules: dict, layers: dict) -> Block | None:
    name = global_name(local, layers)
    if name is None:
        return None
    owner_name, _, leaf = local.rpartition(".")
    owner = modules.get(owner_name)
    sharded = _sharded_tensor(owner, leaf, param)
    dtype = str(param.dtype)
    if sharded is None:
        if getattr(param, "tensor_model_parallel", False) or sharded is False:
            return None  # split by megatron, but no ShardedTensor says how
        shape = tuple(param.shape)
        return Block(name, shape, (0,) * len(shape), shape, dtype)
    return Block(name, tuple(sharded.global_shape), tuple(sharded.global_offset), tuple(param.shape), dtype)


def _sharded_tensor(owner, leaf: str, param):
    """megatron's ShardedTensor for `param` from its module; None where the module has no
    `sharded_state_dict`, False where it has one that does not describe `param` as a plain block."""
    method = getattr(owner, "sharded_state_dict", None)
    if method is None or not _is_megatron_module(owner):
        return None
    from megatron.core import parallel_state as mpu

    metadata = {"dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    try:
        entries = method(prefix="", sharded_offsets=(), metadata=metadata)
    except Exception:  # noqa: BLE001 - an unknown module's layout is refused, never guessed
        return False
    entry = entries.get(leaf)
    if entry is None or not hasattr(entry, "global_shape") or getattr(entry, "prepend_axis_num", 0):
        return False
    if tuple(entry.local_shape) != tuple(param.shape):
        return False
    return entry


def _is_megatron_module(module) -> bool:
    return type(module).__module__.startswith("megatron.")
