"""Which item of a stock Miles native LoRA checkpoint holds one of this run's adapter factors.

Miles' native LoRA (`miles_plugins/lora/`, PR #1792; facts in docs/incoming/nnames.md) names its
factors `<adapter>.<projection>_A` / `_B`. An item is per layer
(`decoder.layers.<n>.self_attention.lora_o_adapter.o_A`) or stacked: the layer number dropped from
the key and a leading axis of `num_layers` added to the shape.

A single-projection adapter (`SINGLE`) maps bit for bit onto this run's factors, Bridge-style
(`<host>.adapter.linear_in.weight`) or Megatron-side (`<host>.lora_A.weight`): same global shape,
same tensor-parallel split. Every other native adapter is refused naming the item (`refusal`).
Pure string and shape logic: no megatron, no Miles.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass

from miles_lora_ckpt.core.global_layout import Block

__all__ = ["Source", "native_sources", "refusal", "resolve"]

# adapted linear -> (the native adapter's attribute on its block, the projection names it may carry)
SINGLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_proj": ("lora_o_adapter", ("o",)),  # attention output (GQA, MLA, Inkling): row-parallel
    "linear_fc2": ("lora_fc2_adapter", ("down", "fc2")),  # MLP / shared-expert down (fc2: Inkling's)
    "linear_q_down_proj": ("lora_mla_q_a_adapter", ("a",)),  # MLA: replicated
    "linear_q_up_proj": ("lora_mla_q_b_adapter", ("b",)),  # MLA: column-parallel
    "linear_kv_down_proj": ("lora_mla_kv_a_adapter", ("a",)),  # MLA: replicated
    "linear_kv_up_proj": ("lora_mla_kv_b_adapter", ("b",)),  # MLA: column-parallel
}

# Why each native adapter that no single-factor adapter holds is refused.
_SPLIT = (
    "a native split adapter (one rank-r A and B per projection, their outputs packed into the fused "
    "{host} output): a single rank-r factor pair cannot hold it bit for bit"
)
_GROUPED = "Inkling's grouped-expert adapter (factors shared by, or stacked over, the local experts)"
_OURS = re.compile(
    r"^(?:(?P<parent>.*)\.)?(?P<host>[A-Za-z_]\w*)\.(?:adapter\.linear_(?P<io>in|out)|lora_(?P<ab>[AB]))\.weight$"
)
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_NATIVE = re.compile(r"(^|\.)(?P<adapter>lora_\w+_adapter|lora_adapter)\.(?P<attr>\w+)_(?P<factor>[AB])$")


@dataclass(frozen=True)
class Source:
    """The checkpoint item `key` holding a factor.

    `layer` is the factor's global layer index on the item's leading axis, or None when the item is
    the factor itself.
    """

    key: str
    layer: int | None = None

    def block(self, wanted: Block, item_size: tuple[int, ...]) -> Block:
        """The part of item `key`, of global shape `item_size`, holding `wanted`'s elements.

        A shape that does not fit (another rank, model size or layer count) raises ValueError naming
        the item.
        """
        if self.layer is None:
            expected = tuple(wanted.global_shape)
        else:
            layers = item_size[0] if item_size else 0
            if not 0 <= self.layer < layers:
                raise ValueError(
                    f"item {self.key!r} has {layers} layer(s) on its leading axis, this model's "
                    f"{wanted.name} is layer {self.layer}"
                )
            expected = (layers, *wanted.global_shape)
        if tuple(item_size) != expected:
            raise ValueError(
                f"adapter parameter {self.key!r} has global shape {list(item_size)} in the checkpoint, "
                f"{list(expected)} for this model's {wanted.name} (another LoRA rank or model size?)"
            )
        if self.layer is None:
            return Block(self.key, expected, wanted.offset, wanted.shape, wanted.dtype)
        return Block(self.key, expected, (self.layer, *wanted.offset), (1, *wanted.shape), wanted.dtype)


def native_sources(name: str) -> list[Source]:
    """The native items that may hold this run's factor `name`, a global name as megatron gives it.

    Per layer, and stacked for a factor inside `layers.<n>.`; [] when no native adapter maps on it.
    """
    match = _OURS.match(name)
    if match is None or match["host"] not in SINGLE:
        return []
    adapter, projections = SINGLE[match["host"]]
    factor = "A" if match["io"] == "in" or match["ab"] == "A" else "B"
    parent = f"{match['parent']}." if match["parent"] else ""
    out = []
    for projection in projections:
        key = f"{parent}{adapter}.{projection}_{factor}"
        out.append(Source(key))
        layer = _LAYER.search(key)
        if layer:
            stacked = key[: layer.start()] + f"{layer[1]}layers." + key[layer.end() :]
            out.append(Source(stacked, int(layer[2])))
    return out


def resolve(name: str, present: Container[str]) -> Source | None:
    """Where the checkpoint's items `present` hold this run's factor `name`, or None if nowhere.

    That is `name` itself, or exactly one of its native names. When two items could hold it, the
    ambiguity raises ValueError; it is never guessed.
    """
    found = [Source(name)] if name in present else []
    found += [s for s in native_sources(name) if s.key in present]
    if len(found) > 1:
        raise ValueError(f"{name} could be read from {len(found)} items of the checkpoint: {[s.key for s in found]}")
    return found[0] if found else None


def refusal(key: str) -> str | None:
    """Why native item `key` cannot warm-start an adapter of a single-factor run, or None.

    None for a `SINGLE` adapter's item, which maps, and for any other name, which is the caller's.
    Refused: split q/k/v and gate/up adapters (no single rank-r factor pair holds them), and
    Inkling's fused fc1, grouped-expert, shared-expert and lm_head adapters.
    """
    match = _NATIVE.search(key)
    if match is None:
        return None
    head, adapter, attr = "." + key[: match.start("adapter")], match["adapter"], match["attr"]
    if adapter == "lora_lm_head_adapter":
        return "Inkling's lm_head adapter"
    if head.endswith(".shared_experts.") and adapter == "lora_adapter":
        return "Inkling's shared-experts adapter (one A per branch, per-sub-expert B)"
    if head.endswith(".experts.") and adapter in ("lora_fc1_adapter", "lora_fc2_adapter"):
        return _GROUPED
    if adapter == "lora_fc1_adapter" and attr == "fc1":
        return "Inkling's fused gate/up adapter (each TP rank's B stacks its own gate and up rows)"
    if adapter == "lora_qkv_adapter":
        return _SPLIT.format(host="linear_qkv")
    if adapter == "lora_fc1_adapter":
        return _SPLIT.format(host="linear_fc1")
    return None
