"""Each trainable parameter's place in the global model, from megatron's own layout knowledge.

`describe` gives a `core.global_layout.Block` for every trainable parameter of every model chunk,
keyed by its chunk-qualified name (as `adapter_shards` names it). Its parts:

- The global name. The chunk prefix is dropped and the chunk-local layer index becomes the
  layer's global one, from the layer module's `layer_number`. Megatron's `TransformerLayer`
  numbers layers globally from 1, across pipeline stages and virtual-pipeline chunks. So
  `chunk1.decoder.layers.0.x` of stage 1 becomes `decoder.layers.6.x`.
- A local expert index (`...experts.local_experts.{i}`, megatron's `SequentialMLP`) becomes its
  global one, from the MoE layer's `local_expert_indices`. An expert parameter without such a
  number (one expert per EP rank, or grouped experts' `weight{i}`) is named with its EP rank and
  size (`...@ep1/2`). It cannot move across EP ranks, so an EP change is refused for it.
- The global shape and this rank's offsets in it come from the owning module's
  `sharded_state_dict` (megatron's `ShardedTensor`). A module without one gives the whole
  parameter (a replicated LoRA factor).
- Under a gated (swiglu) `linear_fc1`, the adapter's output factor has the fused `[gate; up]`
  output on axis 0. It is described from megatron's swiglu factory (`_swiglu_block`).

A model view (a multi-LoRA slot remap's: `savers.multi_lora.remap`) shows the chunk's own
parameters, in order, under other names. It is described through the chunk it shows
(`viewed_chunk`): each parameter's split from its own module, its global name from the name the
view shows.

What cannot be described is None, and a resharding load then refuses the parameter rather than
guess. That is a tensor-parallel parameter whose module gives no `ShardedTensor`, or a gated fc1
output whose factory pieces are not two halves of one block. So is a layer without a
`layer_number`, a local expert without `local_expert_indices`, and every parameter of a chunk
without modules (or a view that does not show its chunk's parameters in order).
"""

from __future__ import annotations

import re

import torch

from miles_lora_ckpt.core.global_layout import Block
from miles_lora_ckpt.megatron.adapter_shards import is_expert, strip_wrappers

_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")
_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)$")
UNNUMBERED_EXPERT = "@ep"  # global-name suffix of an expert parameter without a global expert number

__all__ = ["UNNUMBERED_EXPERT", "describe"]


def describe(model) -> dict[str, dict | None]:
    """`{chunk-qualified name: Block.to_dict() or None}` of every trainable parameter of `model`.

    `model` is one module or Miles' list of chunks, either of them a model view (see above). The
    result is JSON-ready. Nothing is raised: what cannot be described is None (see above).
    """
    chunks = model if isinstance(model, list | tuple) else [model]
    out: dict[str, dict | None] = {}
    for index, chunk in enumerate(chunks):
        real = getattr(chunk, "viewed_chunk", chunk)  # a model view (a slot remap's): its chunk
        shown = list(chunk.named_parameters())
        held = list(real.named_parameters()) if hasattr(real, "named_modules") else []
        if len(held) != len(shown) or any(p is not q for (_, p), (_, q) in zip(held, shown, strict=False)):
            # no modules to ask, or a view that is not its chunk's parameters in order: unknown
            out.update({f"chunk{index}.{strip_wrappers(n)}": None for n, p in shown if p.requires_grad})
            continue
        modules = {strip_wrappers(name): module for name, module in real.named_modules()}
        layers = _global_layer_prefixes(modules)
        for (name, param), (view_name, _) in zip(held, shown, strict=True):
            if not param.requires_grad:
                continue
            # the owning module by the parameter's own name; the global name by the name shown
            local, named = strip_wrappers(name), strip_wrappers(view_name)
            block = _block(local, param, modules, layers, _expert_rank(param, named, layers), named)
            out[f"chunk{index}.{named}"] = None if block is None else block.to_dict()
    return out


def _global_layer_prefixes(modules: dict) -> dict[str, str | None]:
    """`{module path: its global index}` for every numbered layer and expert, None where unknown.

    `decoder.layers.0` maps to its `layer_number - 1`. `...experts.local_experts.1` maps to entry 1
    of the nearest enclosing module's `local_expert_indices` (megatron's MoE layer).
    """
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
    """`"@ep{rank}/{size}"` for an expert parameter without a global expert number, else "".

    Such a parameter's identity is its EP rank's, so it cannot move across EP ranks.
    """
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


def _block(
    local: str, param: torch.nn.Parameter, modules: dict, layers: dict, suffix: str = "", named: str | None = None
) -> Block | None:
    """The block of parameter `local` (its chunk-local name), or None where it is unknown.

    `named` is the name a model view shows it under (None: `local`): the global name is made from
    it, while the split comes from the module that owns the parameter.
    """
    name = global_name(local if named is None else named, layers)
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
    if owner_name.rpartition(".")[2] in (*SWIGLU_OUTPUTS, "linear_fc1") and _under_gated_fc1(local, modules):
        return _swiglu_block(name, sharded, param, dtype)
    return Block(name, tuple(sharded.global_shape), tuple(sharded.global_offset), tuple(param.shape), dtype)


# The adapter factors whose axis 0 is a gated `linear_fc1`'s fused [gate; up] output: Bridge's
# `linear_out` (its `ParallelLinearAdapter.sharded_state_dict` applies megatron's swiglu factory to
# it, not to `linear_in`) and the harness's `lora_B`. The `linear_fc1` linear's own weight and bias
# are described the same way; they are trainable only in a full fine-tune.
SWIGLU_OUTPUTS = ("linear_out", "lora_B")


def _under_gated_fc1(local: str, modules: dict) -> bool:
    """Whether `local` lies under a `linear_fc1` whose MLP uses a gated linear unit (swiglu).

    Megatron describes such an output's TP split with a `ShardedTensorFactory` at the MLP.
    """
    parts = local.split(".")
    for depth, part in enumerate(parts[:-1]):
        if part == "linear_fc1":
            config = getattr(modules.get(".".join(parts[:depth])), "config", None)
            if getattr(config, "gated_linear_unit", False):
                return True
    return False


def _swiglu_block(name: str, sharded, param, dtype: str) -> Block | None:
    """The block of a gated fc1 output parameter, from megatron's swiglu factory.

    Each TP rank holds `[gate_r; up_r]` on axis 0. Megatron's `apply_swiglu_sharded_factory` splits
    that into two `ShardedTensor`s of the one global tensor `[gate; up]`. On axis 0 there are
    2 * TP fragments: the gate half at fragment `r`, the up half at `r + TP`.

    Read in C order, that global tensor is `[2, G/2, ...]`. Rank `r`'s local tensor is its block at
    `(0, o, 0...)` of shape `[2, L/2, ...]`: one plain `Block` with a leading gate/up axis. It is
    the same at every TP size, so a gated fc1 reshards and never meets a non-gated one of equal
    shape. Returns None where the factory's pieces do not have that form: refused, not guessed.
    """
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    if param.dim() < 1 or param.shape[0] % 2:
        return None
    try:
        pieces = apply_swiglu_sharded_factory(sharded, ()).build()
    except Exception:  # noqa: BLE001 - a layout megatron's factory does not take is refused
        return None
    if len(pieces) != 2:
        return None
    gate, up = pieces
    global_shape = tuple(gate.global_shape)
    half = global_shape[0] // 2
    local = tuple(gate.local_shape)
    plain = (
        tuple(up.global_shape) == global_shape
        and tuple(up.local_shape) == local
        and global_shape[0] % 2 == 0
        and local[0] * 2 == param.shape[0]
        and tuple(gate.global_offset[1:]) == tuple(up.global_offset[1:])
        and gate.global_offset[0] + local[0] <= half
        and up.global_offset[0] == gate.global_offset[0] + half
    )
    if not plain:
        return None
    return Block(
        name,
        (2, half, *global_shape[1:]),
        (0, *gate.global_offset),
        (2, *local),
        dtype,
    )


def _sharded_tensor(owner, leaf: str, param):
    """Megatron's ShardedTensor for `param`, from its module `owner`.

    None where the module has no `sharded_state_dict`. False where it has one that does not
    describe `param` as a plain block.
    """
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
