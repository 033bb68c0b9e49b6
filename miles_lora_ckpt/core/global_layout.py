"""Where a rank's local tensor lies in its global tensor, and which saved elements a new layout needs.

Pure slicing math (torch only, no megatron): the layout-independent description that format v3
records for every saved tensor, and the planning of a resharding load from it.

A `Block` says that a local tensor (a rank's parameter, C-contiguous) is the sub-block
`[offset[d], offset[d] + shape[d])` of every dimension `d` of the global tensor `name` of shape
`global_shape` (megatron's `ShardedTensor`: key, global shape, global offset, local shape). A
tensor that is not split is the block at offset zero of its own shape. A block may carry one more
leading axis than the local tensor it describes (a gated `linear_fc1` output: `[2, L, ...]` for
the gate and up halves a TP rank holds as `[2 * L, ...]`); both read alike in C order (`holds`).

`plan_copies` takes the flat element range `[first, stop)` of one wanted block (what a rank of the
new layout needs: a whole adapter weight, or the part of a parameter its DistributedOptimizer shard
holds) and the saved blocks of the same global tensor, and says which flat ranges of which saved
block give those elements, in runs: each wanted element exactly once (replicas of a saved block,
e.g. a dense adapter held by every EP rank, are given once: callers pass distinct blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_lora_ckpt.core import bounded

MAX_DIMS = 8
MAX_EXTENT = 2**40


@dataclass(frozen=True)
class Block:
    """A local tensor's place in its global tensor (see the module docstring)."""

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str = ""  # the parameter's dtype as torch names it ("torch.bfloat16"), "" if unknown

    def __post_init__(self):
        if not (len(self.global_shape) == len(self.offset) == len(self.shape)):
            raise ValueError(f"{self.name}: global shape, offset and shape have different ranks")
        for g, o, s in zip(self.global_shape, self.offset, self.shape, strict=True):
            if not 0 <= o <= o + s <= g:
                raise ValueError(
                    f"{self.name}: block at {list(self.offset)} of shape {list(self.shape)} "
                    f"exceeds the global shape {list(self.global_shape)}"
                )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def holds(self, shape: Sequence[int]) -> bool:
        """Whether a local tensor of `shape`, read in C order, is this block: the same shape, or, for a
        block with a leading gate/up axis (a gated `linear_fc1` output, `param_blocks`), the block's
        shape with its first two dimensions merged (`[2, L, ...]` held as `[2 * L, ...]`)."""
        shape = tuple(shape)
        if shape == self.shape:
            return True
        return (
            len(self.shape) == len(shape) + 1
            and len(shape) >= 1
            and shape[0] == self.shape[0] * self.shape[1]
            and shape[1:] == self.shape[2:]
        )

    @property
    def region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, shape): what two replicas of one block share."""
        return self.offset, self.shape

    def to_dict(self) -> dict:
        """JSON: `{"global": name, "global_shape", "offset", "shape", "dtype"}`."""
        return {
            "global": self.name,
            "global_shape": list(self.global_shape),
            "offset": list(self.offset),
            "shape": list(self.shape),
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Block:
        """Read a `to_dict` value (bounded); raises ValueError naming `where`."""
        bounded.mapping(data, where)
        if set(data) != {"global", "global_shape", "offset", "shape", "dtype"}:
            raise ValueError(f"{where} has keys {sorted(data)}, expected global, global_shape, offset, shape, dtype")
        dims = []
        for key in ("global_shape", "offset", "shape"):
            value = data[key]
            if not isinstance(value, list) or len(value) > MAX_DIMS:
                raise ValueError(f"{where} {key} is {bounded.show(value)}, not a list of at most {MAX_DIMS} sizes")
            dims.append(tuple(bounded.integer(v, f"{where} {key}", high=MAX_EXTENT) for v in value))
        name = bounded.string(data["global"], f"{where} global", max_len=1024)
        dtype = bounded.string(data["dtype"], f"{where} dtype", max_len=64)
        return cls(name, *dims, dtype=dtype)


def global_indices(block: Block, first: int = 0, stop: int | None = None) -> torch.Tensor:
    """Flat indices in the global tensor of the block's local flat elements `[first, stop)`
    (increasing: a block of a C-contiguous tensor read in C order)."""
    stop = block.numel if stop is None else stop
    if not 0 <= first <= stop <= block.numel:
        raise ValueError(f"{block.name}: elements [{first}, {stop}) out of a block of {block.numel}")
    index = torch.arange(math.prod(block.global_shape), dtype=torch.int64).view(block.global_shape)
    for dim, (o, s) in enumerate(zip(block.offset, block.shape, strict=True)):
        index = index.narrow(dim, o, s)
    return index.reshape(-1)[first:stop]


@dataclass(frozen=True)
class Copy:
    """Saved block `source` (its index in the list given), flat elements `[first, first + count)`,
    go to wanted elements `[into, into + count)` (relative to the wanted range's `first`)."""

    source: int
    first: int
    count: int
    into: int


def plan_copies(wanted: Block, first: int, stop: int, saved: Sequence[Block]) -> list[Copy]:
    """Runs of saved elements that give the wanted block's flat elements `[first, stop)`.

    Raises ValueError when a saved block describes another global tensor, or when an element is
    given by no saved block or by two (overlapping saved blocks must be deduplicated first)."""
    for block in saved:
        if block.name != wanted.name or block.global_shape != wanted.global_shape:
            raise ValueError(
                f"{wanted.name}: a saved block of {block.name}{list(block.global_shape)} cannot give "
                f"{wanted.name}{list(wanted.global_shape)}"
            )
    for source, block in enumerate(saved):  # the common case (PP, VPP, EP, DP): the same block, one run
        if block.region == wanted.region and 0 <= first <= stop <= wanted.numel:
            others = [b for i, b in enumerate(saved) if i != source and _overlaps(b, wanted)]
            if not others:
                return [Copy(source, first, stop - first, 0)] if stop > first else []
    need = global_indices(wanted, first, stop)
    covered = torch.zeros(need.numel(), dtype=torch.int64)
    copies: list[Copy] = []
    for source, block in enumerate(saved):
        have = global_indices(block)
        if have.numel() == 0 or need.numel() == 0:
            continue
        at = torch.searchsorted(have, need).clamp(max=have.numel() - 1)
        hit = have[at] == need
        into = torch.nonzero(hit).view(-1)
        if into.numel() == 0:
            continue
        covered[into] += 1
        src = at[into]
        # cut into runs where both the saved and the wanted positions advance by one
        breaks = torch.nonzero((into[1:] - into[:-1] != 1) | (src[1:] - src[:-1] != 1)).view(-1) + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
        ends = torch.cat([breaks, torch.tensor([into.numel()])])
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            copies.append(Copy(source, int(src[s]), e - s, int(into[s])))
    if need.numel() and not bool((covered == 1).all()):
        missing = int((covered == 0).sum())
        twice = int((covered > 1).sum())
        raise ValueError(
            f"{wanted.name}: the saved blocks give {missing} wanted element(s) of [{first}, {stop}) by none "
            f"and {twice} by more than one"
        )
    return sorted(copies, key=lambda c: c.into)


def _overlaps(a: Block, b: Block) -> bool:
    return all(
        max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a.offset, a.shape, b.offset, b.shape, strict=True)
    )


def distinct(blocks: Sequence[Block]) -> list[int]:
    """Indices of the first block of each region (replicas of one block given once)."""
    seen, out = set(), []
    for i, block in enumerate(blocks):
        if block.region not in seen:
            seen.add(block.region)
            out.append(i)
    return out
