"""Adapter weights: which parameters they are and how they map to files.

Names follow Miles' rule for Megatron-side adapters: `lora_` in the name, or `.adapter.` with
`linear_in`/`linear_out`. The wrapper prefixes (`module.`) are removed and the virtual-pipeline
chunk index goes in front (`chunk0.decoder.layers.0...`). So chunks never collide, where stock
Miles' flat dict lets a later chunk overwrite an earlier one.

Dense adapters are replicated over DP, CP and EP; they are stored once per (TP, PP) coordinate,
every chunk of the stage in one file. Expert adapters (`param.allreduce == False`) are stored once
per (PP, EP, expert-TP) coordinate. The saver picks one writer per coordinate: the lowest rank
holding it (DP rank 0, CP rank 0).
"""

from __future__ import annotations

import torch

from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.megatron.topology import Coordinates

__all__ = [
    "adapter_params",
    "copy_into",
    "dense_file",
    "expert_file",
    "is_adapter_param_name",
    "is_expert",
    "preflight_adapter",
    "split_by_kind",
    "strip_wrappers",
]


def is_adapter_param_name(name: str) -> bool:
    """True when the parameter `name` is an adapter weight under Miles' rule (see above)."""
    return "lora_" in name or (".adapter." in name and ("linear_in" in name or "linear_out" in name))


def adapter_params(model) -> dict[str, torch.nn.Parameter]:
    """`{chunk-qualified name: parameter}` of every adapter parameter of every model chunk.

    `model` is one module or Miles' list of virtual-pipeline chunks.
    """
    chunks = model if isinstance(model, list | tuple) else [model]
    params = {}
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if is_adapter_param_name(name):
                params[f"chunk{index}.{strip_wrappers(name)}"] = param
    return params


def strip_wrappers(name: str) -> str:
    """`name` without its leading `module.` wrapper prefixes."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def is_expert(param: torch.nn.Parameter) -> bool:
    """True for an expert adapter: megatron marks those `allreduce = False`."""
    return getattr(param, "allreduce", True) is False


def dense_file(coords: Coordinates) -> str:
    """The generation-relative path of the dense adapter file of `coords`' coordinate."""
    return f"adapter/dense_{coords.dense_key}.safetensors"


def expert_file(coords: Coordinates) -> str:
    """The generation-relative path of the expert adapter file of `coords`' coordinate."""
    return f"adapter/expert_{coords.expert_key}.safetensors"


def split_by_kind(params: dict[str, torch.nn.Parameter]) -> tuple[dict, dict]:
    """`(dense, expert)`: `params` split by `is_expert`, names kept."""
    dense = {n: p for n, p in params.items() if not is_expert(p)}
    expert = {n: p for n, p in params.items() if is_expert(p)}
    return dense, expert


def preflight_adapter(params: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor], file: str) -> None:
    """Check the adapter tensors `saved` (read from `file`) before `params` are overwritten.

    Names, shapes and dtypes must match exactly, and every value must be finite. Returns None;
    raises ValueError naming `file` and the first difference.
    """
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise ValueError(f"{file}: adapter names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, param in params.items():
        tensor = saved[name]
        if tensor.shape != param.shape or tensor.dtype != param.dtype:
            raise ValueError(
                f"{file}: {name} is {tensor.dtype}{list(tensor.shape)}, the model has {param.dtype}{list(param.shape)}"
            )
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ValueError(f"{file}: {name} holds NaN or Inf")


def copy_into(params: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor]) -> None:
    """Copy each tensor of `saved` into the parameter of its name, in place.

    Run `preflight_adapter` first: this does no checks of its own.
    """
    with torch.no_grad():
        for name, param in params.items():
            param.data.copy_(saved[name])
