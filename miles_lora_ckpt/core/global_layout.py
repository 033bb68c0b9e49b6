"""Where a rank's local tensor lies in its global tensor, and which saved elements a layout needs.

Pure slicing math (torch only, no megatron): the layout-independent description that format v3
records for every saved tensor, and the planning of a resharding load from it.

A `Block` says a rank's C-contiguous local tensor is the sub-block
`[offset[d], offset[d] + shape[d])` of every dimension `d` of global tensor `name`, like megatron's
`ShardedTensor`. An unsplit tensor is the block at offset zero of its own shape. A gated
`linear_fc1` block has one more leading axis than the local tensor: `[2, L, ...]` held as
`[2 * L, ...]` (`holds`).

`plan_copies` says which flat ranges of which saved blocks give the elements `[first, stop)` of one
wanted block, each exactly once. Callers pass distinct saved blocks, so replicas count once.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_lora_ckpt.core import bounded

__all__ = [
    "Block",
    "Strided",
    "cut_copies",
    "distinct",
    "fill_problem",
    "global_indices",
    "plan_copies",
    "strided_runs",
    "strided_view",
]

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
        """The number of elements of the local tensor."""
        return math.prod(self.shape)

    def holds(self, shape: Sequence[int]) -> bool:
        """Whether a local tensor of `shape`, read in C order, is this block.

        It is when the shapes match or, for a block with a leading gate/up axis (a gated
        `linear_fc1` output), when `shape` merges the block's first two dimensions.
        """
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
            raise ValueError(
                f"{where} has keys {bounded.names(sorted(data))}, expected global, global_shape, offset, shape, dtype"
            )
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
    """Flat indices in the global tensor of the block's local flat elements `[first, stop)`.

    They increase, since a C-contiguous block is read in C order. A range outside the block raises
    ValueError.
    """
    stop = block.numel if stop is None else stop
    if not 0 <= first <= stop <= block.numel:
        raise ValueError(f"{block.name}: elements [{first}, {stop}) out of a block of {block.numel}")
    index = torch.arange(math.prod(block.global_shape), dtype=torch.int64).view(block.global_shape)
    for dim, (o, s) in enumerate(zip(block.offset, block.shape, strict=True)):
        index = index.narrow(dim, o, s)
    return index.reshape(-1)[first:stop]


@dataclass(frozen=True)
class Copy:
    """Saved block `source`'s elements `[first, first + count)` go to wanted `[into, into + count)`.

    `source` indexes the list given; `into` is relative to the wanted range's `first`.
    """

    source: int
    first: int
    count: int
    into: int


def plan_copies(wanted: Block, first: int, stop: int, saved: Sequence[Block]) -> list[Copy]:
    """Runs of saved elements that give the wanted block's flat elements `[first, stop)`.

    Returns the `Copy` runs sorted by destination. Raises ValueError when a saved block describes
    another global tensor, or an element is given by no saved block or by two. So overlapping saved
    blocks must be deduplicated first.
    """
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
    overlapping = [i for i, block in enumerate(saved) if block.numel and _overlaps(block, wanted)]
    if len(overlapping) == 1 and _contains(saved[overlapping[0]], wanted) and 0 <= first <= stop <= wanted.numel:
        return _copies_from_one(overlapping[0], saved[overlapping[0]], runs(wanted, first, stop), first)
    # general case, run by run (a run: elements contiguous both in the block and in the global
    # tensor, e.g. one row of a row-parallel split): saved runs meeting the wanted runs, merged
    need = runs(wanted, first, stop)
    copies: list[Copy] = []
    for source, block in enumerate(saved):
        if block.numel == 0 or not _overlaps(block, wanted):
            continue
        have, j = runs(block, 0, block.numel), 0
        for start, local, count in need:
            while j < len(have) and have[j][0] + have[j][2] <= start:
                j += 1
            k = j
            while k < len(have) and have[k][0] < start + count:
                lo, hi = max(start, have[k][0]), min(start + count, have[k][0] + have[k][2])
                if hi > lo:
                    into, at = local - first + lo - start, have[k][1] + lo - have[k][0]
                    last = copies[-1] if copies else None
                    if (
                        last
                        and last.source == source
                        and last.into + last.count == into
                        and last.first + last.count == at
                    ):
                        copies[-1] = Copy(source, last.first, last.count + hi - lo, last.into)
                    else:
                        copies.append(Copy(source, at, hi - lo, into))
                k += 1
    copies.sort(key=lambda c: (c.into, c.source))
    missing, twice = _coverage([(c.into, c.into + c.count) for c in copies], stop - first)
    if missing or twice:
        raise ValueError(
            f"{wanted.name}: the saved blocks give {missing} wanted element(s) of [{first}, {stop}) by none "
            f"and {twice} by more than one"
        )
    return copies


def cut_copies(copies: Sequence[Copy], first: int, stop: int) -> list[Copy]:
    """The copies of wanted elements `[first, stop)`, relative to `first`, cut from `copies`.

    `copies` is a plan of the whole wanted block, sorted by `into`. So one plan serves every range
    of a block, such as a DistributedOptimizer shard's part of an adapter weight.
    """
    starts = [c.into for c in copies]
    out = []
    for c in copies[max(0, bisect.bisect_right(starts, first) - 1) :]:
        if c.into >= stop:
            break
        lo, hi = max(first, c.into), min(stop, c.into + c.count)
        if hi > lo:
            out.append(Copy(c.source, c.first + lo - c.into, hi - lo, lo - first))
    return out


def _contains(outer: Block, inner: Block) -> bool:
    return all(
        oo <= oi and oi + si <= oo + so
        for oo, so, oi, si in zip(outer.offset, outer.shape, inner.offset, inner.shape, strict=True)
    )


def _copies_from_one(source: int, block: Block, need: list, first: int) -> list[Copy]:
    """`plan_copies` where one saved block holds every wanted element, the common resharding case.

    Each wanted run lies inside one row, so it is one run of the saved block too, found by
    arithmetic; adjacent runs are merged. The wanted runs are disjoint, so each element comes once.
    """
    global_strides = [math.prod(block.global_shape[d + 1 :]) for d in range(len(block.shape))]
    local_strides = [math.prod(block.shape[d + 1 :]) for d in range(len(block.shape))]
    copies: list[Copy] = []
    for start, local, count in need:
        rest, at = start, 0  # the run's first element: global multi-index -> this block's flat index
        for g_stride, l_stride, o in zip(global_strides, local_strides, block.offset, strict=True):
            index, rest = divmod(rest, g_stride)
            at += (index - o) * l_stride
        into = local - first
        last = copies[-1] if copies else None
        if last is not None and last.into + last.count == into and last.first + last.count == at:
            copies[-1] = Copy(source, last.first, last.count + count, last.into)
        else:
            copies.append(Copy(source, at, count, into))
    return copies


def runs(block: Block, first: int, stop: int) -> list[tuple[int, int, int]]:
    """`(global flat start, local flat start, count)` runs of the block's elements `[first, stop)`.

    The runs are maximal, contiguous in both, and increase in both.
    """
    if stop <= first:
        return []
    shape, offset, global_shape = block.shape, block.offset, block.global_shape
    if not shape:
        return [(0, 0, 1)]
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(shape))]
    d, run = len(shape) - 1, shape[-1]
    while d > 0 and shape[d] == global_shape[d]:  # a whole trailing dimension: runs span the one before it
        d -= 1
        run *= shape[d]
    base = sum(o * st for o, st in zip(offset[d:], strides[d:], strict=True))
    k0, k1 = first // run, -(-stop // run)
    if d == 1:  # one leading dimension (a row-parallel split of a matrix): run k starts at row offset + k
        base += offset[0] * strides[0]
        out = [(base + k * strides[0], k * run, run) for k in range(k0, k1)]
        lo, hi = out[0][1], out[-1][1]
        out[0] = (out[0][0] + first - lo, first, min(stop, lo + run) - first)
        if k1 - k0 > 1:
            out[-1] = (out[-1][0], hi, stop - hi)
        return out
    out = []
    for k in range(k0, k1):
        rest, where = k, base
        for dim in range(d - 1, -1, -1):  # unravel k over the leading dimensions
            rest, index = divmod(rest, shape[dim])
            where += (offset[dim] + index) * strides[dim]
        lo, hi = max(first, k * run), min(stop, (k + 1) * run)
        out.append((where + lo - k * run, lo, hi - lo))
    return out


def _coverage(spans: list[tuple[int, int]], total: int) -> tuple[int, int]:
    """(elements of `[0, total)` in no span, elements in more than one) of `(begin, end)` spans."""
    events = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans] + [(0, 0), (total, 0)])
    missing = twice = depth = 0
    previous = 0
    for at, change in events:
        width = min(at, total) - max(previous, 0)
        if width > 0:
            missing += width if depth == 0 else 0
            twice += width if depth > 1 else 0
        previous = max(previous, at)
        depth += change
    return missing, twice


def _overlaps(a: Block, b: Block) -> bool:
    return all(
        max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a.offset, a.shape, b.offset, b.shape, strict=True)
    )


def distinct(blocks: Sequence[Block]) -> list[int]:
    """Indices of the first block of each region, so replicas of one block count once."""
    seen, out = set(), []
    for i, block in enumerate(blocks):
        if block.region not in seen:
            seen.add(block.region)
            out.append(i)
    return out


@dataclass(frozen=True)
class Strided:
    """One strided copy of `n` runs of `width` elements.

    Run `i` takes source elements `[first + i * step, ... + width)` to destination elements
    `[into + i * into_step, ... + width)`.
    """

    first: int
    step: int
    into: int
    into_step: int
    width: int
    n: int


def strided_runs(runs: Sequence[tuple[int, int, int]]) -> list[Strided]:
    """`(source first, destination first, width)` runs, in order, merged into `Strided` groups.

    A group is consecutive runs of one width whose starts advance by a constant positive step on
    both sides. So the rows of a row-parallel split take one strided view, not a call per row.
    """
    out: list[Strided] = []
    for first, into, width in runs:
        if width <= 0:
            continue
        last = out[-1] if out else None
        if last is not None and last.width == width:
            step, into_step = first - last.first, into - last.into
            if last.n == 1 and step > 0 and into_step >= width:
                out[-1] = Strided(last.first, step, last.into, into_step, width, 2)
                continue
            if last.n > 1 and first == last.first + last.n * last.step and into == last.into + last.n * last.into_step:
                out[-1] = Strided(last.first, last.step, last.into, last.into_step, width, last.n + 1)
                continue
        out.append(Strided(first, 0, into, 0, width, 1))
    return out


def strided_view(flat: torch.Tensor, length: int, start: int, step: int, width: int, n: int) -> torch.Tensor:
    """The `[n, width]` view of a flat tensor of `length` elements, row `i` at `start + i * step`.

    Raises ValueError if a row falls outside; `as_strided` checks only the storage, not the
    tensor's own bounds.
    """
    end = start + (n - 1) * step + width
    if start < 0 or step < 0 or width < 0 or n < 1 or end > length:
        raise ValueError(f"rows [{start}, {end}) (step {step}, width {width}) outside a tensor of {length} elements")
    if n == 1:
        return flat[start : start + width].view(1, width)
    return flat.as_strided((n, width), (step, 1), flat.storage_offset() + start)


def fill_problem(targets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> str | None:
    """Why the ranges a load writes, `spans`, do not fill `targets` exactly once; None when they do.

    `targets` are disjoint `(begin, end)` ranges, such as a shard. The sentence counts elements
    missed, written twice and written outside, and names the first. Every load checks every
    destination shard so before anything is installed.
    """
    points = sorted({p for a, b in (*targets, *spans) if b > a for p in (a, b)})
    at = {p: i for i, p in enumerate(points)}
    written, wanted = [0] * (len(points) + 1), [0] * (len(points) + 1)
    for ranges, counts in ((spans, written), (targets, wanted)):
        for a, b in ranges:
            if b > a:
                counts[at[a]] += 1
                counts[at[b]] -= 1
    missing = twice = outside = 0
    first = None
    depth = want = 0
    for i in range(len(points) - 1):
        depth, want = depth + written[i], want + wanted[i]
        width = points[i + 1] - points[i]
        bad = (want and depth == 0, depth > 1, depth and not want)
        missing, twice, outside = missing + width * bad[0], twice + width * bad[1], outside + width * bad[2]
        if first is None and any(bad):
            first = points[i]
    if first is None:
        return None
    return (
        f"{missing} element(s) would be filled by nothing, {twice} by more than one saved element and "
        f"{outside} outside every destination (first at element {first})"
    )
