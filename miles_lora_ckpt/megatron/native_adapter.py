"""This rank's adapter weights from a stock Miles native `torch_dist` checkpoint, at any TP.

Each adapter parameter's place in the global model comes from megatron itself
(`megatron.param_blocks`): its global name, global shape and this rank's offsets. The
checkpoint's item of that name must exist with the same global shape and dtype. Its saved chunks
are blocks of the same global tensor, so `core.global_layout.plan_copies` says which elements of
which chunk this rank needs, whatever TP the checkpoint was saved at. Only those chunks are read.
Nothing here is collective and nothing is changed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles_lora_ckpt.core import native_dist, native_names
from miles_lora_ckpt.core.dcp_metadata import Metadata, TensorEntry
from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.core.global_layout import Block, distinct, plan_copies
from miles_lora_ckpt.megatron import adapter_shards, param_blocks

__all__ = ["adapter_blocks", "check_names", "read_adapter", "sources"]


def adapter_blocks(model) -> dict[str, Block]:
    """`{chunk-qualified name: Block}` of every adapter parameter of `model`.

    Raises ValueError naming a parameter whose place in the global model megatron does not describe.
    """
    described = param_blocks.describe(model)
    blocks = {}
    for name in adapter_shards.adapter_params(model):
        block = described.get(name)
        if block is None:
            raise ValueError(f"{name}: megatron does not describe its place in the global model, so it cannot be read")
        blocks[name] = Block.from_dict(block, name)
    return blocks


def sources(directory: Path, metadata: Metadata, blocks: dict[str, Block]) -> dict[str, native_names.Source]:
    """`{chunk-qualified name: the checkpoint item holding it}` for each of `blocks` found there.

    `core.native_names.resolve` finds the item in `metadata`. A parameter the checkpoint does not
    hold is left out, and `read_adapter` refuses it. Raises ValueError naming `directory` when two
    items could hold one parameter.
    """
    out = {}
    for name, block in blocks.items():
        try:
            source = native_names.resolve(block.name, metadata.entries)
        except ValueError as exc:
            raise ValueError(f"{directory}: {exc}") from None
        if source is not None:
            out[name] = source
    return out


def check_names(directory: Path, metadata: Metadata, wanted: set[str]) -> None:
    """Check that some rank of this model reads every adapter item of the checkpoint.

    `wanted` holds the items all ranks read; optimizer items are not checked. Returns None. Raises
    ValueError naming `directory` and the items when the checkpoint holds adapter weights this
    model lacks (another set of target modules). It also raises, naming the reason, for a native
    adapter that no single-factor adapter can hold (`core.native_names.refusal`).
    """
    unmapped = sorted(
        (n, reason)
        for n, e in metadata.entries.items()
        if isinstance(e, TensorEntry)
        and not n.startswith("optimizer.")
        and n not in wanted
        and (reason := native_names.refusal(n))
    )
    if unmapped:
        name, reason = unmapped[0]
        raise ValueError(
            f"{directory}: the checkpoint holds {len(unmapped)} Miles native adapter item(s) this run cannot "
            f"load, e.g. {name!r}: {reason}"
        )
    extra = sorted(
        n
        for n, e in metadata.entries.items()
        if isinstance(e, TensorEntry)
        and not n.startswith("optimizer.")
        and adapter_shards.is_adapter_param_name(n)
        and n not in wanted
    )
    if extra:
        raise ValueError(
            f"{directory}: the checkpoint holds {len(extra)} adapter parameter(s) this model does not have, e.g. {extra[:3]}"
        )


def read_adapter(
    model, directory: Path, metadata: Metadata, blocks: dict[str, Block], found: dict[str, native_names.Source]
) -> dict[str, torch.Tensor]:
    """`{chunk-qualified name: tensor}` of this rank's adapter parameters, read from `directory`.

    Each tensor is assembled from the chunks of the item `found` (from `sources`) names. Raises
    ValueError naming the parameter for a missing item, a global-shape or dtype mismatch, missing
    elements or a non-finite value.
    """
    out = {}
    for name, param in adapter_shards.adapter_params(model).items():
        wanted = blocks[name]
        source = found.get(name)
        entry = metadata.entries.get(source.key) if source else None
        if not isinstance(entry, TensorEntry):
            raise ValueError(
                f"{directory}: the checkpoint has no adapter parameter {wanted.name!r} (this model's {name}, "
                f"global shape {list(wanted.global_shape)})"
            )
        try:
            block = source.block(wanted, entry.size)
        except ValueError as exc:
            raise ValueError(f"{directory}: {exc}") from None
        if getattr(torch, entry.dtype) != param.dtype:
            raise ValueError(
                f"{directory}: adapter parameter {block.name!r} is {entry.dtype} there, {param.dtype} here"
            )
        saved = [Block(block.name, entry.size, c.offsets, c.sizes) for c in entry.chunks]
        keep = distinct(saved)
        try:
            copies = plan_copies(block, 0, block.numel, [saved[i] for i in keep])
        except ValueError as exc:
            raise ValueError(f"{directory}: {exc}") from None
        target = torch.empty(block.numel, dtype=param.dtype)
        chunks: dict[int, torch.Tensor] = {}
        for copy in copies:
            index = keep[copy.source]
            if index not in chunks:
                chunks[index] = native_dist.read_chunk(directory, metadata, block.name, entry.chunks[index]).reshape(-1)
            target[copy.into : copy.into + copy.count] = chunks[index][copy.first : copy.first + copy.count]
        tensor = target.view(param.shape)
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ValueError(f"{directory}: adapter parameter {block.name!r} holds NaN or Inf")
        out[name] = tensor
    return out
