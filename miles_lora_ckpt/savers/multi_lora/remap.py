"""Resuming a slot generation into another slot index: what the loader sees instead of the run.

Miles hands slots out dynamically, so an adapter saved from slot `i` may resume into slot `j`.
(v1's `_register_adapter` takes a free slot; v2's controller calls `load_slot` with whichever is
free.) The generation's files name slot `i`'s adapter weights and optimizer children. Rather than
rewrite names inside every file, the single-LoRA loader is given a *view* of the run in which the
two slots trade places:

- `model_view`: the real parameters, with slot `j`'s names read as slot `i`'s and slot `i`'s as
  slot `j`'s (`SlotRemap.view_name`).
- `optimizer_view`: the chain's leaves renumbered (`PermutedLeaves`) so that slot `i`'s saved
  children are the loading slot's children, both in ascending order. The displaced leaves fill
  the freed indices in order.

Every check of the loader then runs unchanged against the saved slot. Shapes, parameter sets,
child classes, families, kinds and state keys must correspond one-to-one, or the load is refused
on every rank before anything changes. Nothing outside the loading slot is written, the co-tenant
at index `i` included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles_lora_ckpt.core.errors import IncompatibleCheckpoint
from miles_lora_ckpt.megatron.optimizer_children.child import PermutedLeaves, leaf_children

# (name, from slot, to slot) -> the name as slot `to` would have it; `name` itself when it is not
# one of slot `from`'s parameters (e.g. the Miles bindings' `rename_miles_slot`)
SlotRenamer = Callable[[str, int, int], str]

__all__ = ["SlotRemap", "SlotRenamer", "model_view", "optimizer_view", "rename_by_pattern"]


@dataclass(frozen=True)
class SlotRemap:
    """A generation saved from slot `saved` loading into slot `slot` (they differ)."""

    saved: int
    slot: int
    rename: SlotRenamer

    def view_name(self, name: str) -> str:
        """`name` with slots `slot` and `saved` swapped; other names unchanged."""
        moved = self.rename(name, self.slot, self.saved)
        return moved if moved != name else self.rename(name, self.saved, self.slot)

    def view_filter(self, adapter_filter: Callable[[str], bool]) -> Callable[[str], bool]:
        """`adapter_filter` (the loading slot's) applied to the real name behind a view name."""

        def in_view(name: str) -> bool:
            return adapter_filter(self.view_name(name))

        return in_view


class _ChunkView:
    """One model chunk whose `named_parameters` carry view names over the real parameters.

    They come in the chunk's own order, so `megatron.param_blocks.describe` places each parameter
    by its module in `viewed_chunk` and names it by its view name.
    """

    def __init__(self, chunk, remap: SlotRemap):
        self._chunk, self._remap = chunk, remap

    @property
    def viewed_chunk(self):
        """The real chunk behind the view."""
        return self._chunk

    def named_parameters(self):
        for name, param in self._chunk.named_parameters():
            yield self._remap.view_name(name), param


def model_view(model, remap: SlotRemap) -> list[_ChunkView]:
    """The model as the loader sees it under `remap`: one view per chunk of `model`.

    Raises ValueError when renaming makes two names of a chunk collide.
    """
    chunks = model if isinstance(model, list | tuple) else [model]
    views = [_ChunkView(chunk, remap) for chunk in chunks]
    for index, (chunk, view) in enumerate(zip(chunks, views, strict=True)):
        real = [n for n, _ in chunk.named_parameters()]
        seen = [n for n, _ in view.named_parameters()]
        if len(set(seen)) != len(real):
            raise ValueError(
                f"slot {remap.saved} -> {remap.slot}: renaming chunk {index}'s parameters makes names collide "
                "(the slot renamer is not a one-to-one swap of the two slots' names)"
            )
    return views


def optimizer_view(
    optimizer, saved_children: list[int] | None, children: list[int]
) -> tuple[PermutedLeaves, list[int]]:
    """`(view, the view's indices of the loading slot's children)` of `optimizer`.

    In the view, `saved_children` stand for `children`, both in ascending order. Raises
    IncompatibleCheckpoint when their counts differ or a saved child is not in this chain.
    """
    count = len(leaf_children(optimizer))
    target = sorted(set(children))
    if saved_children is None:  # saved without an optimizer selection: only the names move
        return PermutedLeaves(optimizer, tuple(range(count))), target
    source = sorted(set(saved_children))
    if len(source) != len(target):
        raise IncompatibleCheckpoint(
            f"the generation saved {len(source)} optimizer children {source}, the loading slot has "
            f"{len(target)} {target}: the slots' optimizer children do not correspond one-to-one"
        )
    unknown = [i for i in source if not 0 <= i < count]
    if unknown:
        raise IncompatibleCheckpoint(f"the generation saved optimizer children {unknown}; this chain has {count}")
    order = list(range(count))
    for position, real in zip(source, target, strict=True):
        order[position] = real
    freed = [p for p in target if p not in source]  # view positions left to the displaced leaves
    displaced = [r for r in source if r not in target]
    for position, real in zip(freed, displaced, strict=True):
        order[position] = real
    return PermutedLeaves(optimizer, tuple(order)), source


def rename_by_pattern(slot_pattern) -> SlotRenamer:
    """A `SlotRenamer` that replaces the slot index in group 1 of the compiled regex `slot_pattern`.

    An example pattern is `\\.adapter\\.adapters\\.(\\d+)\\.`.
    """

    def rename(name: str, source: int, target: int) -> str:
        match = slot_pattern.search(name)
        if match is None or int(match.group(1)) != source:
            return name
        return name[: match.start(1)] + str(target) + name[match.end(1) :]

    return rename
