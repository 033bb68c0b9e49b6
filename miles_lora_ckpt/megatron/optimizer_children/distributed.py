"""The `distributed` family: megatron's DistributedOptimizer, masters and moments sharded over DP.

`DistributedOptimizer.state_dict()` leaves masters and moments out; megatron's own dp-zero helpers
gather everything to one rank, hard-code two moments on 0.16 and silently drop state into an
unallocated optimizer. Here no rank gathers or scatters anything: every DP rank writes, and reads,
its own part.

World tensors. For grad buffer `g`, bucket `b` and key `k` (the master `param` and every state
key), the world tensor is the unpadded part (`numel_unpadded`) of the bucket: its layout does not
depend on the DP size. DP rank `r` of `n` holds elements `[r*L, (r+1)*L)` of the padded bucket
(`L = padded numel / n`), so its slice of the world tensor is `[min(r*L, U), min((r+1)*L, U))`.

Files (no gather): DP rank `r` of `n` writes
`optimizer/child{i}_{coordinate of its DP group's root}_s{r:03d}of{n:03d}.safetensors`, bound to
child `i`, that coordinate and `slice` `"r/n"`, holding for every bucket where its slice is not
empty the tensors `buf{g}.bucket{b}.{k}` (its slice, fp32), written lazily one tensor at a time
(`safetensors_write.LazyTensor`: one bucket slice of one key in memory) with per-block digests. The plan
(`core.child_layouts.DistributedLayout`, manifest metadata `optimizer_children[i].layout`) records
per coordinate `numel_unpadded`, `positions` (format v3) and `slices`: each file with its slice
(`SliceEntry`) and per bucket its bounds `[lo, hi)` in the world tensor.

Load (no scatter): a rank at any DP size reads exactly the element ranges of the saved slices
that overlap its own shard (`protocol.PartialRead`: only those blocks are read and verified; the
protocol verifies every other block round-robin), after checking that the saved slices tile every
bucket exactly (no overlap, no gap). Every load, at any DP size or model-parallel layout, reads
and verifies all of a file's ranges at open in one pass (each block read and hashed once per
load) and keeps them; the masters' cross-check (preflight) and `install` (one bucket and one key
at a time) use those verified buffers: every master gets new data made of them, its object kept
(`replace_masters`), and every moment is replaced by a new tensor made of them (`replace_state`);
on the CPU, at a same layout, both are views of the verified buffers themselves, nothing copied.
The old tensors are untouched, so the undo record keeps them instead of copies. A master on a GPU,
or that is its fp32 parameter's own elements, is copied into in place and read back. The load holds this rank's shard of the optimizer state once beyond
what the optimizer holds. Param groups and the
step travel as JSON (`child.state_dict()` of the DP root). Generations written by the earlier,
gathered layout (one file per coordinate with `buf{g}.{k}` world tensors, written by the DP root;
format 1 too) load the same way: each rank reads its ranges from that file.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from miles_lora_ckpt.core import layout_rules, partial_reads
from miles_lora_ckpt.core.child_layouts import DistributedLayout, SliceEntry
from miles_lora_ckpt.core.errors import GenerationDamaged, IncompatibleCheckpoint, Problem
from miles_lora_ckpt.core.family_kind import FamilyKind
from miles_lora_ckpt.core.global_layout import Block, cut_copies, distinct, fill_problem, strided_runs, strided_view
from miles_lora_ckpt.core.jsoncodec import from_json, to_json
from miles_lora_ckpt.core.layout import MANIFEST
from miles_lora_ckpt.core.protocol import PartialRead
from miles_lora_ckpt.core.safetensors_write import LazyTensor
from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY, Child, has_state, master_replaceable
from miles_lora_ckpt.megatron.optimizer_children.family import (
    ChildDescription,
    Collected,
    OptimizerFile,
    RankView,
    ReadContext,
    ReshardContext,
    SavedChild,
    file_binding,
    saved_state_at,
)
from miles_lora_ckpt.megatron.optimizer_children.masters import check_master, check_master_elements, check_master_rows
from miles_lora_ckpt.megatron.topology import Coordinates

__all__ = [
    "BucketLayout",
    "BucketPart",
    "DistributedHeld",
    "FAMILY",
    "Piece",
    "RestorePart",
    "bucket_layouts",
    "dp_group",
    "main_and_state",
    "overlaps",
    "param_states",
    "range_key",
    "read_part",
    "reads_for",
    "replace_state",
    "saved_pieces",
    "slice_bounds",
    "slice_file_name",
]


def file_name(index: int, coordinate_key: str) -> str:
    """The gathered layout's file (written by the DP root before slices; still read)."""
    return f"optimizer/child{index}_{coordinate_key}.safetensors"


def slice_file_name(index: int, coordinate_key: str, dp_rank: int, dp_size: int) -> str:
    """The file DP rank `dp_rank` of `dp_size` writes for child `index` at `coordinate_key`."""
    return f"optimizer/child{index}_{coordinate_key}_s{dp_rank:03d}of{dp_size:03d}.safetensors"


def slice_binding(index: int, coordinate_key: str, dp_rank: int, dp_size: int) -> dict[str, str]:
    return {**file_binding(index, coordinate_key), "slice": f"{dp_rank}/{dp_size}"}


def local_param_count(child) -> int:
    return sum(
        len(bucket["param_map"]) for maps in child.gbuf_ranges for buckets in maps.values() for bucket in buckets
    )


def dp_group(child):
    """The group the optimizer shards over (DP x CP for dense children, expert DP for experts)."""
    group = getattr(child, "data_parallel_group", None)
    return group if group is not None else child.data_parallel_group_gloo


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class BucketLayout:
    """Where one bucket of one grad buffer lives, for this DP size."""

    buffer_index: int
    bucket_index: int
    world_numel: int  # padded, divisible by the DP size
    numel_unpadded: int

    def local_numel(self, dp_size: int) -> int:
        return self.world_numel // dp_size


def bucket_layouts(child) -> list[BucketLayout]:
    layouts = []
    for g, maps in enumerate(child.gbuf_ranges):
        if len(maps) != 1:
            raise ValueError(f"grad buffer {g} holds {len(maps)} dtypes; megatron supports one")
        for b, _ in enumerate(next(iter(maps.values()))):
            bucket = child.buffers[g].buckets[b]
            layouts.append(BucketLayout(g, b, bucket.grad_data.numel(), bucket.numel_unpadded))
    return layouts


def padded_numels(child) -> dict[str, list[int]]:
    """`{"buf{g}": [padded numel of each bucket]}` (divisible by the DP size)."""
    out: dict[str, list[int]] = {}
    for layout in bucket_layouts(child):
        out.setdefault(f"buf{layout.buffer_index}", []).append(layout.world_numel)
    return out


def unpadded_numels(child) -> dict[str, list[int]]:
    """`{"buf{g}": [numel_unpadded of each bucket]}`: what a payload must match to load."""
    out: dict[str, list[int]] = {}
    for layout in bucket_layouts(child):
        out.setdefault(f"buf{layout.buffer_index}", []).append(layout.numel_unpadded)
    return out


def _param_maps(child, layout: BucketLayout) -> dict:
    maps = child.gbuf_ranges[layout.buffer_index]
    return next(iter(maps.values()))[layout.bucket_index]["param_map"]


def main_and_state(child, model_param) -> tuple[torch.Tensor, dict]:
    """The fp32 master shard of `model_param` held on this rank and its inner-optimizer state."""
    group_index, group_order = child.model_param_group_index_map[model_param]
    main_param = child.optimizer.param_groups[group_index]["params"][group_order]
    return main_param, child.optimizer.state.get(main_param, {})


def param_positions(child, names: dict) -> dict[str, list[int]]:
    """`{name: [buffer, bucket, start, numel]}` of every parameter with a shard on this rank: where
    the whole parameter lies in its bucket's world tensor (format v3: what a resharding load reads)."""
    dp_size = dp_group(child).size() if dp_group(child) is not None else 1
    dp_rank = dp_group(child).rank() if dp_group(child) is not None else 0
    out = {}
    for layout in bucket_layouts(child):
        shard_start = dp_rank * layout.local_numel(dp_size)
        for model_param, ranges in _param_maps(child, layout).items():
            start = shard_start + ranges["gbuf_local"].start - ranges["param"].start
            out[names[id(model_param)]] = [layout.buffer_index, layout.bucket_index, start, model_param.numel()]
    return out


def param_states(child) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """(model parameter, this rank's fp32 master shard, its state) for every parameter with a shard here."""
    return [(p, *main_and_state(child, p)) for p in child.model_param_group_index_map]


# --------------------------------------------------------------------------- plan


def slice_bounds(padded: dict, unpadded: dict, dp_rank: int, dp_size: int) -> dict[str, list[list[int]]]:
    """`{"buf{g}": [[lo, hi] per bucket]}`: DP rank `dp_rank`'s slice of each bucket's world tensor."""
    bounds = {}
    for buf, numels in sorted(unpadded.items()):
        per_rank = [p // dp_size for p in padded[buf]]
        bounds[buf] = [[min(dp_rank * n, u), min((dp_rank + 1) * n, u)] for n, u in zip(per_rank, numels, strict=True)]
    return bounds


@dataclass(frozen=True)
class DistributedHeld:
    """What one rank holds of a DistributedOptimizer child (`DistributedFamily.describe`).

    The numel and position maps stay JSON: `plan_slices` records them in the manifest as they are.
    """

    params: tuple[str, ...]  # the names of the parameters it steps, sorted
    dp_rank: int | None  # its rank in the child's DP group (None: no group)
    dp_size: int | None  # that group's size
    dp_root: int | None  # the global rank of that group's first member
    numel_unpadded: dict[str, list[int]]  # `{"buf{g}": [unpadded numel per bucket]}`
    numel_padded: dict[str, list[int]]  # `{"buf{g}": [padded numel per bucket]}`
    positions: dict[str, list[int]]  # `param_positions`: where each parameter lies in its bucket

    def to_json(self) -> dict:
        """Its fields as JSON, under the keys the plan always had."""
        return {
            "params": list(self.params),
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "dp_root": self.dp_root,
            "numel_unpadded": self.numel_unpadded,
            "numel_padded": self.numel_padded,
            "positions": self.positions,
        }

    @classmethod
    def parse(cls, data: dict) -> DistributedHeld:
        """From `to_json`'s keys (in a `ChildDescription`'s payload)."""
        return cls(
            params=tuple(data["params"]),
            dp_rank=data["dp_rank"],
            dp_size=data["dp_size"],
            dp_root=data["dp_root"],
            numel_unpadded=data["numel_unpadded"],
            numel_padded=data["numel_padded"],
            positions=data.get("positions", {}),
        )


def plan_slices(index: int, described: list[ChildDescription | None], ranks: list[Coordinates]) -> DistributedLayout:
    """Pure: per DP group (keyed by its root's coordinate) the bucket layout and every rank's slice."""
    groups: dict[int, list[DistributedHeld]] = {}
    for desc in described:
        if desc is not None:
            if desc.held.dp_rank is None:
                raise ValueError(f"optimizer child {index} (DistributedOptimizer) has no data-parallel group")
            groups.setdefault(desc.held.dp_root, []).append(desc.held)
    numels, slices, positions = {}, {}, {}
    for root, members in sorted(groups.items()):
        key, first = ranks[root].model_parallel_key, members[0]
        size = first.dp_size
        for held in members:
            if (held.dp_size, held.numel_unpadded, held.numel_padded) != (
                size,
                first.numel_unpadded,
                first.numel_padded,
            ):
                raise ValueError(f"optimizer child {index}: the DP group at {key} disagrees about its buckets")
        if sorted(held.dp_rank for held in members) != list(range(size)):
            raise ValueError(f"optimizer child {index}: the DP group at {key} does not have ranks 0..{size - 1}")
        numels[key] = first.numel_unpadded
        positions[key] = _merged_positions(index, key, members)
        slices[key] = tuple(
            SliceEntry(
                slice_file_name(index, key, r, size),
                f"{r}/{size}",
                slice_bounds(first.numel_padded, first.numel_unpadded, r, size),
            )
            for r in range(size)
        )
    return DistributedLayout(numels, slices, positions)


def _merged_positions(index: int, key: str, members: list[DistributedHeld]) -> dict[str, list[int]]:
    """Every DP rank's `positions` of one group, which must agree where they overlap (format v3)."""
    merged: dict[str, list[int]] = {}
    for held in members:
        for name, where in held.positions.items():
            if merged.setdefault(name, where) != where:
                raise ValueError(f"optimizer child {index}: the DP group at {key} disagrees where {name} lies")
    return dict(sorted(merged.items()))


# --------------------------------------------------------------------------- save


def _slice_tensor(child, layout: BucketLayout, key: str, count: int) -> torch.Tensor:
    """This rank's first `count` elements of one bucket's shard for `key` (a fresh fp32 tensor:
    the only copy of optimizer state the save makes, one at a time)."""
    out = torch.zeros(count, dtype=torch.float32)
    for model_param, ranges in _param_maps(child, layout).items():
        main_param, state = main_and_state(child, model_param)
        start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
        if end > count:
            raise ValueError(f"a parameter lies in the padding of {layout} (elements {start}..{end} of {count})")
        source = main_param if key == MASTER_KEY else state[key]
        out[start:end].copy_(source.detach().view(-1))
    return out


def check_state_keys(child, keys: tuple[str, ...]) -> None:
    for model_param in child.model_param_group_index_map:
        _, state = main_and_state(child, model_param)
        for key in keys:
            if key not in state:
                raise KeyError(f"optimizer state of a parameter has no {key!r} (has {sorted(state)})")


def lazy_slices(child, keys: tuple[str, ...], bounds: dict) -> dict[str, LazyTensor]:
    """`{"buf{g}.bucket{b}.{key}": LazyTensor}` of this rank's non-empty slices (produced when written)."""
    tensors = {}
    for layout in bucket_layouts(child):
        lo, hi = bounds[f"buf{layout.buffer_index}"][layout.bucket_index]
        if hi <= lo:
            continue
        for key in (MASTER_KEY, *keys):
            name = f"buf{layout.buffer_index}.bucket{layout.bucket_index}.{key}"
            produce = lambda layout=layout, key=key, n=hi - lo: _slice_tensor(child, layout, key, n)  # noqa: E731
            tensors[name] = LazyTensor(torch.float32, (hi - lo,), produce)
    return tensors


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Piece:
    """A saved part of a buffer's world tensor: elements `[begin, end)` of buffer `buf` (all its
    buckets' unpadded parts, concatenated) are tensors `{prefix}.{key}` of `file`."""

    file: str
    binding: dict
    prefix: str
    buf: str
    begin: int
    end: int


class BucketPart(NamedTuple):
    """One saved range that fills part of this rank's shard of a bucket (`_row_parts`)."""

    piece: Piece  # the saved piece it is read from
    first: int  # its first element in the piece
    stop: int  # one past its last element in the piece
    offset: int  # where it goes in this rank's shard of the bucket
    # None: `[first, stop)` goes to `[offset, ...)`; else a strided group of rows inside one
    # parameter, `(step, width, n, offset step)`
    rows: tuple[int, int, int, int] | None


class RestorePart(NamedTuple):
    """A `BucketPart` with the verified ranges it is read from (`_Restore.buckets`)."""

    piece: Piece
    source: Any  # the piece's file's verified ranges (`ReadContext.ranges`)
    first: int
    stop: int
    offset: int
    rows: tuple[int, int, int, int] | None


def saved_pieces(index: int, plan: DistributedLayout, key: str, current: dict) -> list[Piece]:
    """Every saved piece of child `index` at `key`, checked: the bucket layout is this run's, and
    the slices tile each bucket exactly (no overlap, no gap). Legacy (gathered) layouts: one piece
    per buffer in the DP root's file."""
    layouts = plan.numel_unpadded
    if key not in layouts:
        raise IncompatibleCheckpoint(
            f"optimizer child {index}: the checkpoint has no bucket layout for model-parallel coordinate {key} "
            f"(missing key {key!r} in 'numel_unpadded'; it has {sorted(layouts)[:8]})"
        )
    saved = layouts[key]
    if saved != current:
        raise IncompatibleCheckpoint(
            f"optimizer child {index} at {key}: bucket layout differs: checkpoint {saved}, this run {current}"
        )
    offsets = {buf: [sum(numels[:b]) for b in range(len(numels))] for buf, numels in current.items()}
    if plan.slices is None:  # gathered layout: the DP root wrote the world tensors
        binding = file_binding(index, key)
        return [Piece(file_name(index, key), binding, buf, buf, 0, sum(n)) for buf, n in sorted(current.items())]
    entries = plan.slices.get(key)
    problem = layout_rules.slice_problem(index, key, entries, current)
    if problem is not None:  # verify's rule: each slice named by its place, the slices tiling every bucket
        file, why = problem
        raise GenerationDamaged(f"{file}: {why}")
    pieces, size = [], len(entries)
    for rank, entry in enumerate(entries):
        expected, binding = slice_file_name(index, key, rank, size), slice_binding(index, key, rank, size)
        for buf, per_bucket in entry.bounds.items():
            for b, (lo, hi) in enumerate(per_bucket):
                if hi > lo:  # an empty slice holds no piece
                    begin = offsets[buf][b]
                    pieces.append(Piece(expected, binding, f"{buf}.bucket{b}", buf, begin + lo, begin + hi))
    return pieces


def shard_ranges(held: DistributedHeld) -> list[tuple[str, int, int, int]]:
    """(buffer, bucket, begin, end): a rank's shard of each bucket's world tensor in buffer
    coordinates, from what it holds (`dp_rank`, `dp_size`, padded and unpadded numels)."""
    out = []
    for buf in sorted(held.numel_unpadded, key=lambda name: int(name.removeprefix("buf"))):
        start = 0
        pairs = zip(held.numel_padded[buf], held.numel_unpadded[buf], strict=True)
        for b, (padded, unpadded) in enumerate(pairs):
            n = padded // held.dp_size
            lo, hi = min(held.dp_rank * n, unpadded), min((held.dp_rank + 1) * n, unpadded)
            out.append((buf, b, start + lo, start + hi))
            start += unpadded
    return out


def reads_for(pieces: list[Piece], held: DistributedHeld) -> list[tuple[int, Piece, int, int, int]]:
    """(bucket position, piece, first, stop, offset in the bucket's shard) for every overlap of
    this rank's shard with a saved piece."""
    out = []
    for position, (buf, _, begin, end) in enumerate(shard_ranges(held)):
        for piece in pieces:
            lo, hi = max(begin, piece.begin), min(end, piece.end)
            if piece.buf == buf and hi > lo:
                out.append((position, piece, lo - piece.begin, hi - piece.begin, lo - begin))
    return out


def overlaps(spans: list[tuple[int, int]], parts: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """`(span index, part index, lo, hi)` for every non-empty overlap `[lo, hi)` of `spans`
    (`(start, end)`, pairwise disjoint, as megatron's parameters in one bucket are) with `parts`
    (`(offset, count)`): each part finds its spans by bisection, so the cost is the number of parts
    and overlaps (a resharding load has thousands of pieces per bucket), not their product."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    starts = [spans[i][0] for i in order]
    for before, after in zip(order, order[1:], strict=False):
        if spans[before][1] > spans[after][0]:
            raise ValueError(f"parameters overlap in a bucket: elements {spans[before]} and {spans[after]}")
    out = []
    for j, (offset, count) in enumerate(parts):
        k = max(bisect.bisect_right(starts, offset) - 1, 0)
        while k < len(order) and spans[order[k]][0] < offset + count:
            start, end = spans[order[k]]
            lo, hi = max(start, offset), min(end, offset + count)
            if hi > lo:
                out.append((order[k], j, lo, hi))
            k += 1
    return out


def replace_state(child, key: str, layout: BucketLayout, parts: list, allocated: frozenset = frozenset()) -> None:
    """Install state `key` of one bucket's parameters from `(offset in this rank's shard of the
    bucket, tensor, its element count, rows)` parts (views of the verified ranges), never writing a
    tensor the optimizer held before the load: the old tensors stay as they were, and
    `undo.UndoRecord` keeps them, not copies (see `replaces`).

    A parameter whose elements lie inside one part of the same dtype and device as its tensor, the
    part being the whole of its verified buffer (every parameter of a same-layout load on the CPU),
    gets a view of that part: the verified bytes become the state, with no copy to make or read
    back. Any other is copied, and read back (`_copy_parts`), into the tensor this load's `allocate` made for it
    (`(id(master), key)` in `allocated`: nothing to keep, no second tensor), or else into a new
    `torch.empty_like` of its old tensor, which then replaces it."""
    fresh: dict = {}  # main param -> the tensor that replaces its old one
    copied = []  # (start, end, destination) of the parameters that are not views of one part
    whole = sorted(((o, c, t) for o, t, c, rows in parts if rows is None), key=lambda p: p[0])
    starts = [o for o, _, _ in whole]
    for model_param, ranges in _param_maps(child, layout).items():
        main_param, state = main_and_state(child, model_param)
        if key not in state:
            raise KeyError(f"optimizer state was not allocated for {key!r}")
        old = state[key]
        start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
        if old.numel() != end - start:
            raise ValueError(f"optimizer state {key!r} holds {old.numel()} elements, its shard {end - start}")
        view = _view_of_one_part(whole, starts, start, end, old)
        if view is not None:
            fresh[main_param] = view
        elif (id(main_param), key) in allocated and old.is_contiguous():
            copied.append((start, end, old))
        else:
            fresh[main_param] = torch.empty_like(old, memory_format=torch.contiguous_format)
            copied.append((start, end, fresh[main_param]))
    _copy_parts(key, copied, parts)
    for main_param, tensor in fresh.items():
        child.optimizer.state[main_param][key] = tensor


def replace_masters(child, layout: BucketLayout, parts: list, in_place: bool = False) -> None:
    """Install one bucket's fp32 masters from `(offset in this rank's shard of the bucket, tensor, its
    element count, rows)` parts, never writing into a master `master_replaceable` allows to replace
    (`undo.UndoRecord` keeps its old data, not a copy, see `replaces`): megatron holds each master
    object in its own lists (param groups, `shard_fp32_from_float16_groups`, `main_param`), so the
    object stays and its data is swapped (`master.data = new`). The new data is the part itself
    when the master's elements are one whole verified buffer (`_view_of_one_part`: a same-layout
    load on the CPU, nothing to copy or read back), else a new tensor the parts are copied into and
    read back (`_copy_parts`). A master that is its fp32 parameter's own elements is written in
    place, and read back; with `in_place` (a child that never stepped, see `_Restore`) every master
    is: the verified buffer then goes back, where new data would leave the old in the heap."""
    fresh: dict = {}  # master -> its new data
    spans = []  # (start, end, destination) of the masters that are copied into
    whole = sorted(((o, c, t) for o, t, c, rows in parts if rows is None), key=lambda p: p[0])
    starts = [o for o, _, _ in whole]
    for model_param, ranges in _param_maps(child, layout).items():
        main_param, _ = main_and_state(child, model_param)
        start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
        if main_param.numel() != end - start:
            raise ValueError(f"an fp32 master holds {main_param.numel()} elements, its shard {end - start}")
        if in_place or not master_replaceable(main_param, model_param):
            spans.append((start, end, main_param))
            continue
        view = _view_of_one_part(whole, starts, start, end, main_param)
        if view is None:
            view = torch.empty_like(main_param, memory_format=torch.contiguous_format)
            spans.append((start, end, view))
        fresh[main_param] = view
    _copy_parts(MASTER_KEY, spans, parts)
    with torch.no_grad():
        for main_param, tensor in fresh.items():
            main_param.data = tensor


def _view_of_one_part(whole: list, starts: list[int], start: int, end: int, old: torch.Tensor):
    """A view shaped like `old` of the part (`(offset, count, tensor)`, sorted by offset) holding
    shard elements `[start, end)`, when one does, matches `old`'s dtype and device, and is its whole
    buffer (a part cut from a larger verified span, e.g. a resharding load's rows merged within
    blocks, is copied instead: a view would keep the whole span alive with the state); else None."""
    i = bisect.bisect_right(starts, start) - 1
    if i < 0 or end == start:
        return None
    offset, count, tensor = whole[i]
    if end > offset + count or tensor.dtype != old.dtype or tensor.device != old.device:
        return None
    owns_buffer = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == count * tensor.element_size()
    if not owns_buffer:
        return None
    return tensor[start - offset : end - offset].view(old.shape)


def _copy_parts(key: str, spans: list, mine: list) -> None:
    """Copy `(offset in this rank's shard of the bucket, tensor, its element count, rows)` parts into
    the `(start, end, destination)` spans (parameters' shard elements) they overlap, then compare
    every copied element. A parameter's pieces (one per row of a row-parallel split at another TP)
    are copied as few strided groups (`global_layout.strided_runs`): torch calls per parameter, not
    per row. `rows` not None: the piece is such a group already (`_Restore.buckets`), row `i` of
    `(step, width, n, offset step)` its elements `[i * step, ... + width)`, going to
    `[offset + i * offset step, ... + width)`, inside one parameter."""
    copies = []  # (destination view, source view)
    by_target: dict[int, list] = {}
    for i, j, lo, hi in overlaps([(a, b) for a, b, _ in spans], [(o, _extent(c, r)) for o, _, c, r in mine]):
        offset, tensor, count, rows = mine[j]
        if rows is not None:
            copies.append(_row_views(spans[i], spans[i][2].view(-1), lo, hi, offset, tensor, count, rows))
            continue
        whole = lo == offset and hi == offset + count  # no slicing call for a piece inside one parameter
        by_target.setdefault(i, []).append(
            (lo - spans[i][0], tensor if whole else tensor[lo - offset : hi - offset], hi - lo)
        )
    for i, pieces in sorted(by_target.items()):  # per parameter: few strided groups of its pieces
        copies += _strided_groups(spans[i][2].view(-1), spans[i][1] - spans[i][0], pieces)
    with torch.no_grad():
        for into, source in copies:
            into.copy_(source)
    for into, source in copies:  # megatron's own loader can drop state silently: not here
        # read back from where it landed (a GPU's state comes back to the verified host bytes)
        if not torch.equal(into.detach().to(source.device), source):
            raise ValueError(f"optimizer state {key!r} did not arrive intact for a parameter")


def _extent(count: int, rows) -> int:
    """Elements of the shard a part spans: `count`, or its rows' span (`_Restore.buckets`)."""
    return count if rows is None else (rows[2] - 1) * rows[3] + rows[1]


def _rows_inside(lo: int, hi: int, offset: int, count: int, rows) -> None:
    """Raise unless a strided part's overlap `[lo, hi)` with a parameter is the whole part."""
    if lo != offset or hi != offset + _extent(count, rows):
        raise ValueError(f"a resharding load's rows [{offset}, {offset + _extent(count, rows)}) cross a parameter")


def _row_views(span: tuple, dest: torch.Tensor, lo: int, hi: int, offset: int, tensor, count: int, rows) -> tuple:
    """`(destination view, source view)`, both `[n, width]`, of a strided part (`rows`) that must lie
    inside the parameter whose shard elements are `span` (`(start, end, ...)`)."""
    _rows_inside(lo, hi, offset, count, rows)
    step, width, n, into_step = rows
    return (
        strided_view(dest, span[1] - span[0], offset - span[0], into_step, width, n),
        strided_view(tensor, count, 0, step, width, n),
    )


def _strided_groups(dest: torch.Tensor, numel: int, pieces: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`[(destination view, source)]` for `(first element, values, count)` pieces of one flat
    destination of `numel` elements: one pair per group of like pieces (`strided_runs`), the
    group's values concatenated (one `cat`), the destination a strided `[n, width]` view."""
    out, at = [], 0
    runs = []
    for first, _, count in pieces:
        runs.append((at, first, count))
        at += count
    done = 0
    for g in strided_runs(runs):
        values = [piece for _, piece, _ in pieces[done : done + g.n]]
        done += g.n
        source = (values[0] if g.n == 1 else torch.cat(values)).view(g.n, g.width)
        out.append((strided_view(dest, numel, g.into, g.into_step, g.width, g.n), source))
    return out


def _gathered(pieces: list) -> tuple[torch.Tensor, torch.Tensor]:
    """`(positions, values)` of `(first element, values, count)` pieces of one flat destination: one
    index copy (and one read-back) per parameter and key, however many pieces a resharding load cut
    it into (one per row of a row-parallel split at another TP)."""
    firsts = torch.tensor([first for first, _, _ in pieces], dtype=torch.int64)
    counts = torch.tensor([count for _, _, count in pieces], dtype=torch.int64)
    before = torch.cumsum(counts, 0) - counts
    index = torch.repeat_interleave(firsts - before, counts) + torch.arange(int(counts.sum()), dtype=torch.int64)
    return index, torch.cat([piece for _, piece, _ in pieces])


def check_master_shard(child: Child, layout: BucketLayout, parts: list, adapter) -> None:
    """Every saved master element of this rank's shard of one bucket (`(file, offset in the shard,
    tensor, its element count, rows)` parts, `rows` as in `_copy_parts`) is the cast of the saved adapter's matching element (`masters.check_master`)."""
    params = []
    for model_param, ranges in _param_maps(child.optimizer, layout).items():
        source = adapter(model_param)
        if source is not None:
            params.append((ranges["gbuf_local"].start, ranges["gbuf_local"].end, ranges["param"].start, source))
    found = overlaps([(a, b) for a, b, _, _ in params], [(o, _extent(c, r)) for _, o, _, c, r in parts])
    grouped: dict[tuple[int, str], list] = {}  # (parameter, file) -> [(first element in the parameter, master, count)]
    for i, j, lo, hi in found:
        start, _, first, _ = params[i]
        file, offset, tensor, count, rows = parts[j]
        if rows is not None:  # a strided group of rows inside this parameter: one comparison
            _rows_inside(lo, hi, offset, count, rows)
            master = strided_view(tensor, count, 0, rows[0], rows[1], rows[2])
            where = f"{file} (optimizer child {child.index})"
            check_master_rows(params[i][3], master, where, first + offset - start, rows[3])
            continue
        whole = lo == offset and hi == offset + count
        grouped.setdefault((i, file), []).append(
            (first + lo - start, tensor if whole else tensor[lo - offset : hi - offset], hi - lo)
        )
    for (i, file), pieces in grouped.items():  # one comparison per parameter and file, not per piece
        where = f"{file} (optimizer child {child.index})"
        if len(pieces) == 1:
            check_master(params[i][3], pieces[0][1], where, pieces[0][0])
        else:
            positions, values = _gathered(pieces)
            check_master_elements(params[i][3], values, where, positions)


# --------------------------------------------------------------------------- resharding


@dataclass(frozen=True)
class _SavedPosition:
    """One saved copy of a parameter in a child's buckets: the coordinate, its name there, its block."""

    where: str  # the saved coordinate key
    name: str  # its chunk-qualified name there
    block: Block
    position: tuple  # (buffer, bucket, start, numel) in that coordinate's buckets


@dataclass(frozen=True)
class Resharded:
    """`DistributedFamily.plan_reshard`'s plan of one child on this rank."""

    keys: tuple[str, ...]
    coordinates: tuple[str, ...]  # the saved coordinates it draws from (their JSON states must agree)
    buckets: tuple[tuple[BucketPart, ...], ...]  # per bucket of this rank, its parts (`_row_parts`)
    files: tuple[PartialRead, ...]  # the element ranges of the saved slice files it reads
    never_stepped: bool = False  # the child never stepped on any rank (`_Restore.never_stepped`)


def _described_positions(
    index: int, plan: DistributedLayout, described: list, mine: ChildDescription, view: RankView
) -> dict:
    """The `positions` a child record lacks (one written before format v3 recorded them), for a
    load at the saved layout: each DP group's as this run describes them, as a save records them
    (`plan_slices`). Its own group's bucket layout must be the saved one, as the reader of each
    rank's own files checks it (`saved_pieces`: the same refusal); then so is every position in
    it. Raises IncompatibleCheckpoint where it is not, or where the child has no DP group."""
    if mine.held.dp_rank is None:
        raise IncompatibleCheckpoint(f"optimizer child {index} has no data-parallel group")
    saved_pieces(index, plan, view.ranks[mine.held.dp_root].model_parallel_key, mine.held.numel_unpadded)
    try:
        return plan_slices(index, described, view.ranks).positions
    except ValueError as exc:
        raise IncompatibleCheckpoint(str(exc)) from None


def _optimizer_sources(index: int, positions, saved: dict, manifest) -> dict[str, list[_SavedPosition]]:
    """`{global name: [_SavedPosition]}` of one child's saved `positions` (checked by
    `layout_rules.saved_blocks`: inside their buckets, one parameter each, of their blocks' sizes)."""
    if positions is None:
        raise IncompatibleCheckpoint(f"optimizer child {index}: the checkpoint records no parameter positions")
    sources: dict[str, list[_SavedPosition]] = {}
    for key, named in sorted(positions.items()):
        for name, where in sorted(named.items()):
            block = saved.get(key, {}).get(name)
            if block is None or block.numel != where[3]:
                raise layout_rules.damaged(
                    manifest, MANIFEST, f"optimizer child {index} at {key}: {name} has no matching global block"
                )
            sources.setdefault(block.name, []).append(_SavedPosition(key, name, block, tuple(where)))
    return sources


def _row_parts(piece: Piece, runs: list, manifest) -> list[BucketPart]:
    """One parameter's `(first, offset in the shard, count)` runs of one saved piece, as
    `BucketPart`s: a strided group of rows (`strided_runs`, e.g. the half rows
    of a row-parallel split at another TP) is one part whose range `[first, stop)` covers them all
    and `rows` is `(step, width, n, offset step)`; a lone run is `rows` None. A group is covered
    only where the elements between its rows lie in blocks read and verified anyway (a gap shorter
    than the file's block), so nothing more is read or kept; otherwise its rows stay parts of
    their own. One range asked per group, not per row."""
    record = manifest.files.get(piece.file)
    blocks = getattr(record, "blocks", None)
    gap_limit = None if blocks is None else blocks.block_bytes // 4  # fp32 elements (`_read_piece`)
    out = []
    for g in strided_runs(runs):
        if g.n == 1:
            out.append(BucketPart(piece, g.first, g.first + g.width, g.into, None))
        elif gap_limit is None or g.step - g.width <= gap_limit:
            stop = g.first + (g.n - 1) * g.step + g.width
            out.append(BucketPart(piece, g.first, stop, g.into, (g.step, g.width, g.n, g.into_step)))
        else:
            out += [
                BucketPart(piece, g.first + i * g.step, g.first + i * g.step + g.width, g.into + i * g.into_step, None)
                for i in range(g.n)
            ]
    return out


def _coalesced(parts: list[BucketPart]) -> list[BucketPart]:
    """One bucket's parts (`_row_parts`) with every run of lone parts that follow each other in one
    piece and in the shard merged into one part. At the saved layout a bucket's parameters lie
    back to back in its slices, so the read is one range per slice, as a same-layout load's."""
    lone = sorted((p for p in parts if p.rows is None), key=lambda p: (p.piece.file, p.piece.prefix, p.first))
    out = [p for p in parts if p.rows is not None]
    merged: list[BucketPart] = []
    for part in lone:
        if merged:
            last = merged[-1]
            if (
                last.piece is part.piece
                and last.stop == part.first
                and last.offset + (last.stop - last.first) == part.offset
            ):
                merged[-1] = last._replace(stop=part.stop)
                continue
        merged.append(part)
    return merged + out


def _part_spans(part: BucketPart) -> list[tuple[int, int]]:
    """The shard elements `(begin, end)` a bucket part (`_row_parts`) fills: one range, or its rows."""
    if part.rows is None:
        return [(part.offset, part.offset + part.stop - part.first)]
    _, width, n, into_step = part.rows
    return [(part.offset + i * into_step, part.offset + i * into_step + width) for i in range(n)]


# --------------------------------------------------------------------------- the family


@dataclass
class _Restore:
    keys: tuple[str, ...]
    state: dict  # the DP root's `state_dict()` (decoded, groups settled): param groups and step
    buckets: list[list[RestorePart]]  # per bucket of this rank, its parts with their verified ranges
    groups: list = field(default_factory=list)  # the saved param groups, settled, in the live groups' order
    # `(id(master), key)` of the state tensors `allocate` made (the optimizer held none before)
    allocated: frozenset = frozenset()
    # the child never stepped on any rank (`child.never_stepped`): its masters are the cast of the
    # parameters, which the undo record remakes them from, so `install` writes them in place
    never_stepped: bool = False


class DistributedFamily:
    """`ChildFamily` for DistributedOptimizer children (see the module docstring)."""

    kind = FamilyKind.DISTRIBUTED
    dp_elastic = True  # world tensors are laid out independently of the DP size

    def describe(self, child: Child, coords: Coordinates, names: dict, saving: bool) -> DistributedHeld:
        opt = child.optimizer
        group = dp_group(opt)
        root = (dist.get_process_group_ranks(group)[0] if dist.is_initialized() else 0) if group is not None else None
        return DistributedHeld(
            params=tuple(sorted(names[id(p)] for p in opt.model_param_group_index_map)),
            dp_rank=group.rank() if group is not None else None,
            dp_size=group.size() if group is not None else None,
            dp_root=root,
            numel_unpadded=unpadded_numels(opt),
            numel_padded=padded_numels(opt),
            positions=param_positions(opt, names),
        )

    def parse_held(self, data: dict) -> DistributedHeld:
        return DistributedHeld.parse(data)

    def plan(self, index: int, described: list[ChildDescription | None], ranks: list[Coordinates]) -> DistributedLayout:
        return plan_slices(index, described, ranks)

    def collect(self, child: Child, view: RankView, plan: DistributedLayout, keys: tuple[str, ...]) -> Collected:
        opt = child.optimizer
        if local_param_count(opt) > 0 and not has_state(opt):
            raise ValueError(f"optimizer child {child.index} has stepped on other ranks but has no state here")
        check_state_keys(opt, keys)
        group = dp_group(opt)
        key = view.ranks[dist.get_process_group_ranks(group)[0] if dist.is_initialized() else 0].model_parallel_key
        rank, size = group.rank(), group.size()
        entry = plan.slices[key][rank]
        tensors = lazy_slices(opt, keys, entry.bounds)
        file = OptimizerFile(slice_binding(child.index, key, rank, size), tensors, partial_reads=True)
        collected = Collected({entry.file: file})
        if rank == 0:
            collected.state_key = f"{child.index}:{key}"
            collected.state = to_json(opt.state_dict(), f"optimizer child {child.index}")
        return collected

    def exchange_for_save(
        self, child: Child, view: RankView, plan: DistributedLayout, collected: Collected
    ) -> dict[str, OptimizerFile]:
        """No collectives: every DP rank writes its own slice (lazily, see `lazy_slices`)."""
        return collected.local

    def _pieces(self, index: int, view: RankView, described: list, plan: DistributedLayout) -> list[Piece]:
        mine = described[view.rank].held
        if mine.dp_rank is None:
            raise IncompatibleCheckpoint(f"optimizer child {index} has no data-parallel group")
        root_key = view.ranks[mine.dp_root].model_parallel_key
        return saved_pieces(index, plan, root_key, mine.numel_unpadded)

    def files_to_read(self, index: int, view: RankView, described: list, plan: DistributedLayout) -> list:
        """`PartialRead`s of exactly the element ranges of the saved slices that overlap this rank's
        shard (at equal DP sizes: all of its own slice), every key's, kept: each block is read and
        verified once per load, at open, and the masters' cross-check (preflight) and `install` use
        those verified buffers, so the load holds this rank's shard of the optimizer state once
        beyond what the optimizer holds (`install` gives each master's back once it is copied, and
        the moments' become the new state).

        Into a child that never stepped on any rank (a relaunch: `never_stepped`, the same answer
        on every rank) the moments are verified at open but not kept (`PartialRead(keep=False)`),
        and `install` reads each again, verified again, into the buffer that becomes the state:
        the load then holds the adapter, the masters' shard and one moment range at a time, not
        the whole shard beyond what the optimizer holds."""
        mine = described[view.rank]
        pieces = self._pieces(index, view, described, plan)
        defer = all(d is None or d.never_stepped for d in described)
        keys = (MASTER_KEY, *mine.keys)
        requests: dict[tuple[str, bool], set] = {}
        for _, piece, first, stop, _ in reads_for(pieces, mine.held):
            for k in keys:
                keep = k == MASTER_KEY or not defer
                requests.setdefault((piece.file, keep), set()).add((f"{piece.prefix}.{k}", first, stop))
        return [PartialRead(file, tuple(sorted(ranges)), keep) for (file, keep), ranges in sorted(requests.items())]

    def preflight(
        self, child: Child, view: RankView, described: list, plan: DistributedLayout, read: ReadContext
    ) -> _Restore:
        mine = described[view.rank].held
        root_key = view.ranks[mine.dp_root].model_parallel_key
        state = read.states.get(f"{child.index}:{root_key}")
        if state is None:
            raise ValueError(f"the training state holds no optimizer state for child {child.index} at {root_key}")
        state = from_json(state)
        groups = state.get("optimizer", {}).get("param_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list):
            raise ValueError(f"the training state of optimizer child {child.index} at {root_key} has no param groups")
        # unknown keys refused, differences from the launch reported and settled (core.hyperparameters)
        where = f"optimizer child {child.index} at {root_key}"
        read.hyperparameters.param_groups(where, groups, child.optimizer.optimizer.param_groups)
        if mine.numel_unpadded != unpadded_numels(child.optimizer):
            raise ValueError(f"optimizer child {child.index} changed its buckets since it was described")
        buckets: list[list] = [[] for _ in shard_ranges(mine)]
        for position, piece, first, stop, offset in reads_for(self._pieces(child.index, view, described, plan), mine):
            source = read.ranges(piece.file, piece.binding)  # binding checked; ranges verified at open
            buckets[position].append(RestorePart(piece, source, first, stop, offset, None))
        for position, (buf, b, begin, end) in enumerate(shard_ranges(mine)):
            # every element of this rank's shard filled exactly once (the check a resharding load makes too)
            spans = [(offset, offset + stop - first) for _, _, first, stop, offset, _ in buckets[position]]
            problem = fill_problem([(0, end - begin)], spans)
            if problem is not None:
                raise GenerationDamaged(
                    "the generation loaded",
                    [
                        Problem(
                            MANIFEST, f"optimizer child {child.index}: {buf} bucket {b} of this rank's shard: {problem}"
                        )
                    ],
                )
        if read.adapter is not None:  # the saved adapter must be the cast of these masters (masters.py)
            for layout, pieces in zip(bucket_layouts(child.optimizer), buckets, strict=True):
                parts = [
                    (piece.file, *read_part(piece, source, MASTER_KEY, first, stop, offset, rows))
                    for piece, source, first, stop, offset, rows in pieces
                ]  # one bucket's master shard at a time (views of the ranges verified at open)
                check_master_shard(child, layout, parts, read.adapter)
                del parts
        never_stepped = all(d is None or d.never_stepped for d in described)
        return _Restore(read.keys, state, buckets, groups, never_stepped=never_stepped)

    def plan_reshard(self, child: Child, saved: SavedChild, layout: ReshardContext) -> Resharded:
        """Every parameter element of this rank's shards at another layout: which element ranges of
        which saved slice files hold its master and moments (`protocol.PartialRead`: only those
        blocks are read and verified), and where they go in the shard."""
        index, opt = child.index, child.optimizer
        keys = saved.keys
        described = layout.described.get(index, [])
        mine = described[layout.view.rank] if layout.view is not None and described else None
        positions = saved.layout.positions
        if positions is None and layout.saved_layout and mine is not None:
            positions = _described_positions(index, saved.layout, described, mine, layout.view)
        sources = _optimizer_sources(index, positions, layout.saved, layout.manifest)
        # the copies this rank's own DP group wrote first: at the saved layout it reads its own slices
        own = None if mine is None or mine.held.dp_root is None else layout.view.ranks[mine.held.dp_root]
        own = None if own is None else own.model_parallel_key
        # into a child that never stepped on any rank the moments may be verified at open but not
        # kept, and read again at install (`files_to_read`'s reason)
        never = bool(described) and all(d is None or d.never_stepped for d in described)
        defer = layout.defer_moments and never
        pieces = {
            key: saved_pieces(index, saved.layout, key, saved.layout.numel_unpadded[key])
            for key in sorted({s.where for found in sources.values() for s in found})
        }
        offsets = {
            key: {buf: [sum(n[:b]) for b in range(len(n))] for buf, n in numels.items()}
            for key, numels in saved.layout.numel_unpadded.items()
        }
        requests: dict[str, set] = {}
        used, buckets = set(), []
        for bucket in bucket_layouts(opt):
            parts, targets = [], []
            for model_param, ranges in _param_maps(opt, bucket).items():
                name = layout.names[id(model_param)]
                block = layout.block_of(name)
                found = sorted(sources.get(block.name, []), key=lambda s: s.where != own)
                found = [found[i] for i in distinct([s.block for s in found])]
                first, stop = ranges["param"].start, ranges["param"].end
                try:
                    copies = cut_copies(layout.copies(block, [s.block for s in found]), first, stop)
                except ValueError as exc:
                    raise IncompatibleCheckpoint(f"optimizer child {index}, parameter {name}: {exc}") from None
                runs: dict = {}  # id(piece) -> (piece, [(first, offset in the shard, count)]), in shard order
                for copy in copies:
                    source = found[copy.source]
                    used.add(source.where)
                    buf, number, start, _ = source.position
                    lo = offsets[source.where][f"buf{buf}"][number] + start + copy.first
                    hi = lo + copy.count
                    into = ranges["gbuf_local"].start + copy.into
                    for piece in pieces[source.where]:
                        a, b = max(lo, piece.begin), min(hi, piece.end)
                        if piece.buf == f"buf{buf}" and b > a:
                            runs.setdefault(id(piece), (piece, []))[1].append((a - piece.begin, into + (a - lo), b - a))
                for piece, found_runs in runs.values():
                    parts += _row_parts(piece, found_runs, layout.manifest)
                targets.append((ranges["gbuf_local"].start, ranges["gbuf_local"].end))
            parts = _coalesced(parts)
            for part in parts:
                for k in (MASTER_KEY, *keys):
                    keep = k == MASTER_KEY or not defer
                    requests.setdefault((part.piece.file, keep), set()).add(
                        range_key(part.piece, k, part.first, part.stop, part.rows)
                    )
            # every element of this rank's shard of the bucket filled exactly once, as a same-layout
            # load checks its shard (`preflight`): no master or moment left as it was allocated
            problem = fill_problem(targets, [span for part in parts for span in _part_spans(part)])
            if problem is not None:
                raise layout_rules.damaged(
                    layout.manifest,
                    MANIFEST,
                    f"optimizer child {index}, buf{bucket.buffer_index} bucket {bucket.bucket_index} of this "
                    f"rank's shard: {problem}: the saved positions and blocks do not give it",
                )
            buckets.append(tuple(parts))
        files = tuple(PartialRead(f, tuple(sorted(r)), keep) for (f, keep), r in sorted(requests.items()))
        if not used and own is not None:  # no parameter in this rank's shard: its own group's state
            used.add(own)
        return Resharded(keys, tuple(sorted(used)), tuple(buckets), files, never)

    def restore_resharded(self, child: Child, plan: Resharded, read: ReadContext) -> _Restore:
        """The verified ranges of the plan (kept at open; `install` installs from them), the masters
        checked against their adapter one bucket at a time, the saved state of the coordinates
        drawn from (which must agree)."""
        index, opt = child.index, child.optimizer
        state = saved_state_at(index, plan.coordinates, read.states)
        groups = len(state.get("optimizer", {}).get("param_groups", [])) if isinstance(state, dict) else None
        if groups is not None and groups != len(opt.optimizer.param_groups):
            raise IncompatibleCheckpoint(
                f"optimizer child {index}: the checkpoint has {groups} param group(s), this run "
                f"{len(opt.optimizer.param_groups)}"
            )
        buckets = [
            [
                RestorePart(p.piece, read.ranges(p.piece.file, p.piece.binding), p.first, p.stop, p.offset, p.rows)
                for p in parts
            ]
            for parts in plan.buckets
        ]
        if read.adapter is not None:  # one bucket's master shard at a time, views of the verified ranges
            for bucket, parts in zip(bucket_layouts(opt), buckets, strict=True):
                masters = [
                    (piece.file, *read_part(piece, source, MASTER_KEY, first, stop, offset, rows))
                    for piece, source, first, stop, offset, rows in parts
                ]
                check_master_shard(child, bucket, masters, read.adapter)
        state = from_json(state)  # as the same-layout preflight hands it to `allocate`
        groups = state.get("optimizer", {}).get("param_groups", [])
        if read.hyperparameters is not None:
            read.hyperparameters.param_groups(f"optimizer child {index}", groups, opt.optimizer.param_groups)
        return _Restore(plan.keys, state, buckets, groups, never_stepped=plan.never_stepped)

    def allocate(self, child: Child, restore: _Restore) -> None:
        opt = child.optimizer
        had = {id(p): set(s) for p, s in opt.optimizer.state.items()}
        # megatron pairs saved and live param groups by identifying keys (0.19: max_lr and min_lr
        # among them), so a checkpoint whose values differ from the launch's would find no group:
        # it is handed the live groups (and the saved step), then every group gets the settled
        # saved values, in order (core.hyperparameters compared them pairwise in preflight)
        live = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        steps = [{"step": g["step"]} if "step" in g else {} for g in restore.groups]
        paired = [{**group, **step} for group, step in zip(live, steps, strict=True)]
        opt.load_state_dict({**restore.state, "optimizer": {**restore.state["optimizer"], "param_groups": paired}})
        for group, saved in zip(opt.optimizer.param_groups, restore.groups, strict=True):
            group.update(saved)
        _drop_planted_keys(opt, restore.keys, had)
        restore.allocated = frozenset(
            (id(main), key)
            for main, state in opt.optimizer.state.items()
            for key in restore.keys
            if key in state and key not in had.get(id(main), ())
        )

    def replaces(self, restore: _Restore) -> tuple[str, ...]:
        """The state keys `install` replaces with new tensors instead of writing into the old ones:
        every moment, and `MASTER_KEY`: the masters `master_replaceable` allows get new data
        (`replace_masters`: megatron holds the master objects in its own lists, so those stay);
        not into a child that never stepped, whose masters `install` writes in place."""
        return restore.keys if restore.never_stepped else (MASTER_KEY, *restore.keys)

    def install(self, child: Child, restore: _Restore) -> None:
        """Bucket by bucket and key by key: this rank's pieces of one bucket for one key (views of
        the ranges verified at open). The masters get new data made of them (`replace_masters`: on
        the CPU, at a same layout, the verified bytes themselves; a master on a GPU, or that is its
        fp32 parameter's own elements, is copied into in place), read back bit for bit where copied;
        every moment is replaced by a new tensor made of them (`replace_state`: on the CPU, at a
        same layout, the verified bytes themselves)."""
        opt = child.optimizer
        for layout, pieces in zip(bucket_layouts(opt), restore.buckets, strict=True):
            for key in (MASTER_KEY, *restore.keys):  # one key of one bucket at a time
                parts = [
                    read_part(piece, source, key, first, stop, offset, rows)
                    for piece, source, first, stop, offset, rows in pieces
                ]
                if key == MASTER_KEY:
                    replace_masters(opt, layout, parts, in_place=restore.never_stepped)
                else:
                    replace_state(opt, key, layout, parts, restore.allocated)
                del parts
                for piece, source, first, stop, _, rows in pieces:  # a range kept until now is used no more
                    _forget(source, range_key(piece, key, first, stop, rows))


def _forget(source, wanted) -> None:
    """Drop one verified range from what a load keeps (the `{range: tensor}` dict of
    `protocol.OpenedGeneration.ranges`; a file read whole keeps its tensors): a master's buffer
    goes back once it is copied."""
    if isinstance(source, dict):
        source.pop(tuple(wanted), None)
    elif hasattr(source, "drop"):  # `protocol.DeferredRanges`: some ranges kept, others read again
        source.drop(wanted)


def range_key(piece: Piece, key: str, first: int, stop: int, rows) -> tuple:
    """The element range (`partial_reads.ElementRange`) a bucket part of `piece` is read as, for state
    `key`: `[first, stop)`, or for a strided group of rows (`rows`, see `_Restore.buckets`) the
    strided range of those rows, which a read returns compact (`partial_reads.strided_rows`)."""
    name = f"{piece.prefix}.{key}"
    return (name, first, stop) if rows is None else (name, first, stop, rows[0], rows[1])


def read_part(piece: Piece, source, key: str, first: int, stop: int, offset: int, rows) -> tuple:
    """`(offset in the shard, tensor, its element count, rows)` of one bucket part for state `key`,
    from its verified range (`range_key`). A strided group's rows were read compact, so its `rows`
    becomes `(width, width, n, offset step)`, or None where they go to consecutive shard elements
    (a parameter's whole shard at DP 1: one buffer of its own, which an install adopts as the state
    as it does a same-layout load's, `_view_of_one_part`)."""
    tensor = _read_piece(piece, source, range_key(piece, key, first, stop, rows))
    if rows is None:
        return offset, tensor, stop - first, None
    _, width, n, into_step = rows
    return offset, tensor, n * width, None if into_step == width else (width, width, n, into_step)


def _read_piece(piece: Piece, source, wanted: tuple) -> torch.Tensor:
    """One verified range of a piece (fp32, `partial_reads.range_numel(wanted)` elements)."""
    name, first, stop = wanted[:3]
    try:
        tensor = source.get(wanted)
    except ValueError as exc:
        raise ValueError(f"{piece.file}: {exc}") from None
    if tensor is None:
        raise ValueError(f"{piece.file}: {name} elements [{first}, {stop}) were not read")
    expected = partial_reads.range_numel(wanted)
    if tensor.dtype != torch.float32 or tensor.numel() != expected:
        raise ValueError(f"{piece.file}: {name}: {tensor.dtype}[{tensor.numel()}], expected torch.float32[{expected}]")
    return tensor


def _drop_planted_keys(child, keys: tuple[str, ...], had: dict) -> None:
    # megatron 0.16's load_state_dict plants an uninitialised `exp_avg_sq` even for one-moment
    # optimizers; keep only what the optimizer really uses (and what it had before).
    for main_param, state in child.optimizer.state.items():
        for key in [k for k in state if k not in keys and k != "step" and k not in had.get(id(main_param), ())]:
            del state[key]


FAMILY = DistributedFamily()
