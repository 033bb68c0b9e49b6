"""Each trainable parameter's place in the global model, from megatron's own layout knowledge.

For every trainable parameter of every model chunk (chunk-qualified name, as `adapter_shards`
names it) a `core.global_layout.Block`:

- the global name: the chunk prefix dropped and the chunk-local layer index replaced by the
  layer's global one, read from the layer module's `layer_number` (megatron's `TransformerLayer`
  numbers its layers globally from 1, across pipeline stages and virtual-pipeline chunks, from
  `get_transformer_layer_offset`), so `chunk1.decoder.layers.0.x` of stage 1 becomes
  `decoder.layers.6.x`; and a local expert index (`...experts.local_experts.{i}`, megatron's
  `SequentialMLP`) replaced by its global one from the MoE layer's `local_expert_indices`
  (`ep_rank * num_local_experts + i`); an expert parameter without such a number (one expert per
  EP rank, or grouped experts' `weight{i}`) is named with its EP rank and size (`...@ep1/2`): it
  cannot move across EP ranks, so an EP change is refused for it;
- the global shape and this rank's offsets in it: from the owning module's `sharded_state_dict`
  (megatron's `ShardedTensor`: global shape, global offset; a column-parallel linear splits
  axis 0, a row-parallel one axis 1), or, for a module without one, the whole parameter (a
  replicated LoRA factor).

What cannot be described is None (and a model view without modules, e.g. a slot remap's, is
described as None throughout) (the parameter is then refused by a resharding load, never
guessed): a parameter megatron marks tensor-parallel whose module gives no `ShardedTensor` for it,
one split over TP under a gated (swiglu) `linear_fc1`, which megatron describes with a
`ShardedTensorFactory` at the MLP (each TP rank holds its own gate and up halves: not resharded
yet; at TP 1 it is whole), a
layer index without a `layer_number`, or a local expert without `local_expert_indices` (grouped
experts' `weight{i}` are not renumbered yet).
"""

from __future__ import annotations

import re

import torch

from miles_lora_ckpt.core.global_layout import Block
from miles_lora_ckpt.megatron.adapter_shards import is_expert, strip_wrappers

_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")
_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)$")
UNNUMBERED_EXPERT = "@ep"  # global-name suffix of an expert parameter without a global expert number


def describe(model) -> dict[str, dict | None]:
    """`{chunk-qualified name: Block.to_dict() or None}` of every trainable parameter (JSON)."""
    chunks = model if isinstance(model, list | tuple) else [model]
    out: dict[str, dict | None] = {}
    for index, chunk in enumerate(chunks):
        if not hasattr(chunk, "named_modules"):  # a view of renamed parameters (slot remap): unknown
            out.update(
                {f"chunk{index}.{strip_wrappers(n)}": None for n, p in chunk.named_parameters() if p.requires_grad}
            )
            continue
        modules = {strip_wrappers(name): module for name, module in chunk.named_modules()}
        layers = _global_layer_prefixes(modules)
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            local = strip_wrappers(name)
            block = _block(local, param, modules, layers, _expert_rank(param, local, layers))
            out[f"chunk{index}.{local}"] = None if block is None else block.to_dict()
    return out


def _global_layer_prefixes(modules: dict) -> dict[str, str | None]:
    """`{module path: its global index}` for every numbered layer and expert (None where unknown):
    `decoder.layers.0` -> its `layer_number - 1`; `...experts.local_experts.1` -> entry 1 of the
    nearest enclosing module's `local_expert_indices` (megatron's MoE layer)."""
    renames: dict[str, str | None] = {}
    for name, module in modules.items():
        layer, expert = _LAYER.search(name), _EXPERT.search(name)
        if layer:
            number = getattr(module, "layer_number", None)
            ok = isinstance(number, int) and not isinstance(number, bool) and number >= 1
            renames[name] = str(number - 1) if ok else None
        elif expert:
            renames[name] = _global_expert(name, int(expert.group(2)), modules)
    return renames


def _global_expert(name: str, local: int, modules: dict) -> str | None:
    parts = name.split(".")
    for depth in range(len(parts) - 2, -1, -1):
        indices = getattr(modules.get(".".join(parts[:depth])), "local_expert_indices", None)
        if indices is not None:
            ok = isinstance(indices, list | tuple) and local < len(indices) and isinstance(indices[local], int)
            return str(indices[local]) if ok else None
    return None


def global_name(local: str, renames: dict[str, str | None]) -> str | None:
    """`local` with every numbered layer and expert index made global; None where one is unknown."""
    parts = local.split(".")
    for depth in range(1, len(parts)):
        path = ".".join(local.split(".")[:depth])
        if path in renames:
            if renames[path] is None:
                return None
            parts[depth - 1] = renames[path]
    return ".".join(parts)


def _expert_rank(param, local: str, renames: dict) -> str:
    """`"@ep{rank}/{size}"` for an expert parameter without a global expert number (its identity is
    its EP rank's: such parameters cannot move across EP ranks), else ""."""
    if not is_expert(param):
        return ""
    numbered = any(_EXPERT.search(path) for path in renames if local.startswith(path + "."))
    if numbered:
        return ""
    from megatron.core import parallel_state as mpu

    try:
        rank, size = mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no parallel state: one EP rank
        rank, size = 0, 1
    return f"{UNNUMBERED_EXPERT}{rank}/{size}"


def _block(local: str, param: torch.nn.Parameter, modules: dict, layers: dict, suffix: str = "") -> Block | None:
    name = global_name(local, layers)
    if name is None:
        return None
    name += suffix
    owner_name, _, leaf = local.rpartition(".")
    owner = modules.get(owner_name)
    sharded = _sharded_tensor(owner, leaf, param)
    dtype = str(param.dtype)
    if sharded is None:
        if getattr(param, "tensor_model_parallel", False) or sharded is False:
            return None  # split by megatron, but no ShardedTensor says how
        shape = tuple(param.shape)
        return Block(name, shape, (0,) * len(shape), shape, dtype)
    if tuple(sharded.global_shape) != tuple(param.shape) and _under_gated_fc1(local, modules):
        return None  # swiglu: each TP rank holds its own gate and up halves, not one block
    return Block(name, tuple(sharded.global_shape), tuple(sharded.global_offset), tuple(param.shape), dtype)


def _under_gated_fc1(local: str, modules: dict) -> bool:
    """Whether `local` lies under a `linear_fc1` whose MLP uses a gated linear unit (swiglu): megatron
    describes such a split with a `ShardedTensorFactory` at the MLP, which is not resharded yet."""
    parts = local.split(".")
    for depth, part in enumerate(parts[:-1]):
        if part == "linear_fc1":
            config = getattr(modules.get(".".join(parts[:depth])), "config", None)
            if getattr(config, "gated_linear_unit", False):
                return True
    return False


def _sharded_tensor(owner, leaf: str, param):
    """megatron's ShardedTensor for `param` from its module; None where the module has no
    `sharded_state_dict`, False where it has one that does not describe `param` as a plain block."""
    method = getattr(owner, "sharded_state_dict", None)
    if method is None or not _is_megatron_module(owner):
        return None
    from megatron.core import parallel_state as mpu

    try:
        metadata = {"dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
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
