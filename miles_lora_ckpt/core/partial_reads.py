"""Verified partial reads: only the blocks of a file that hold the element ranges asked for.

A file written with per-block digests (`save_tensors(blocks=True)`) is read in part: `read_ranges`
reads the blocks under the ranges asked (each block's digest checked against the manifest's block
index, the header parsed strictly and checked against it, every floating value read checked finite);
`check_blocks` verifies blocks no reader reads. An element range is `(name, first, stop)` of a
flattened tensor or, strided, `(name, first, stop, step, width)`: rows returned compact.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from miles_lora_ckpt.core.digest import StreamingDigest
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.file_reader import open_checked
from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.core.host_memory import large_buffer
from miles_lora_ckpt.core.layout import BlockIndex, FileRecord
from miles_lora_ckpt.core.read_ahead import will_need
from miles_lora_ckpt.core.safetensors_format import DTYPES, FLOAT_TAGS, check_block_spans, parse_header

if TYPE_CHECKING:
    import torch

__all__ = [
    "ElementRange",
    "blocks_needed",
    "byte_range",
    "check_blocks",
    "cut_range",
    "indexed_tensor",
    "mark_blocks",
    "range_numel",
    "read_ranges",
    "strided_rows",
]

# (tensor name, first element, end element) of a flattened tensor; or, strided,
# (name, first, end, step, width): the rows `first + i * step + [0, width)` (`strided_rows`)
ElementRange = tuple


def strided_rows(wanted: ElementRange) -> tuple[int, int, int] | None:
    """`(step, width, n)` of a strided element range `(name, first, stop, step, width)`: its `n`
    rows, row `i` the elements `[first + i * step, first + i * step + width)`, the last ending at
    `stop`; None for a plain range `(name, first, stop)`. A read of a strided range verifies every
    block under `[first, stop)`, as a plain one does, and returns its rows only, one after the
    other (`n * width` elements: `range_numel`). Raises ValueError for any other shape."""
    if len(wanted) == 3:
        return None
    if len(wanted) != 5 or not all(type(v) is int for v in wanted[1:]):
        raise ValueError(f"an element range is (name, first, stop) or (name, first, stop, step, width), not {wanted!r}")
    _, first, stop, step, width = wanted
    if width <= 0 or step < width or stop - first < width or (stop - first - width) % step:
        raise ValueError(f"strided element range {wanted!r}: rows of {width} every {step} do not end at {stop}")
    return step, width, (stop - first - width) // step + 1


def range_numel(wanted: ElementRange) -> int:
    """How many elements a read of `wanted` returns: `stop - first`, or a strided range's rows'."""
    rows = strided_rows(wanted)
    return wanted[2] - wanted[1] if rows is None else rows[1] * rows[2]


def cut_range(flat, wanted: ElementRange):
    """Elements `wanted` of a flat tensor that holds elements `[first, stop)` of `wanted`'s tensor:
    `flat` itself for a plain range, a new compact tensor of the rows for a strided one."""
    from miles_lora_ckpt.core.global_layout import strided_view  # torch: imported where it is used

    rows = strided_rows(wanted)
    if rows is None:
        return flat
    step, width, n = rows
    return strided_view(flat, flat.numel(), 0, step, width, n).reshape(-1).clone()


def byte_range(index: BlockIndex, wanted: ElementRange) -> tuple[int, int]:
    """The absolute bytes `[begin, end)` of an element range, from the manifest's block index."""
    name, first, stop = wanted[:3]
    strided_rows(wanted)  # a strided range's rows must end at its stop
    if name not in index.tensors:
        raise GenerationDamaged(f"tensor {name!r} is not in the file")
    tag, begin, end = index.tensors[name]
    itemsize = DTYPES[tag][1]
    if not 0 <= first <= stop <= (end - begin) // itemsize:
        raise GenerationDamaged(f"tensor {name!r}: elements [{first}, {stop}) out of its {(end - begin) // itemsize}")
    return begin + first * itemsize, begin + stop * itemsize


def indexed_tensor(index: BlockIndex, name: str) -> tuple[str, int] | None:
    """`(torch dtype name, element count)` of tensor `name` as the manifest's block index records
    it (its dtype tag and byte range; the header must agree, `read_ranges` checks), None if absent."""
    if name not in index.tensors:
        return None
    tag, begin, end = index.tensors[name]
    torch_name, itemsize = DTYPES[tag]
    return torch_name, (end - begin) // itemsize


def blocks_needed(index: BlockIndex, wanted: Iterable[ElementRange]) -> set[int]:
    """The blocks a partial read of `wanted` reads and verifies: the header's and every range's."""
    needed = set(index.blocks_for(0, index.data_start))
    for item in wanted:
        needed.update(index.blocks_for(*byte_range(index, item)))
    return needed


def mark_blocks(index: BlockIndex, wanted: Iterable[ElementRange], touched: bytearray) -> None:
    """Set `touched[i]` for every block `i` an element range of `wanted` touches (the blocks
    `blocks_needed` names, less the header's), range by range without sorting or merging them
    first: one pass over many short ranges (a resharding load's rows). Raises ValueError for a
    range the file does not hold, as `byte_range` does."""
    block_bytes, tensors = index.block_bytes, index.tensors
    for name, first, stop, *_ in wanted:  # a strided range: every block under [first, stop)
        if name not in tensors:
            raise GenerationDamaged(f"tensor {name!r} is not in the file")
        tag, begin, end = tensors[name]
        itemsize = DTYPES[tag][1]
        if not 0 <= first <= stop <= (end - begin) // itemsize:
            raise GenerationDamaged(
                f"tensor {name!r}: elements [{first}, {stop}) out of its {(end - begin) // itemsize}"
            )
        if stop > first:
            lo, hi = (begin + first * itemsize) // block_bytes, (begin + stop * itemsize - 1) // block_bytes
            if lo == hi:
                touched[lo] = 1
            else:
                touched[lo : hi + 1] = b"\x01" * (hi + 1 - lo)


class _BlockFile:
    """Verified random access to one open file, block by block (only the last block is kept).

    Blocks read in file order from block 0 on, with none skipped, are also hashed into the whole
    file's digest: when a reader ends up reading every block so (`whole_digest`), it checks the
    manifest's file digest too, as a whole read does, without reading anything more."""

    def __init__(self, fd: int, record: FileRecord):
        self.fd, self.record, self.index = fd, record, record.blocks
        self._last: tuple[int, memoryview] | None = None
        self._whole, self._next = StreamingDigest(), 0
        self._buffer = large_buffer(min(self.index.block_bytes, record.bytes))  # reused block after block

    def block(self, i: int, into: memoryview | None = None) -> memoryview:
        """Block `i`, read and its digest checked: into `into` when given (exactly the block's
        length: the caller's destination, so its bytes are copied nowhere else), otherwise into
        the reused buffer, kept as the last block."""
        if self._last is not None and self._last[0] == i:
            if into is not None:
                into[:] = self._last[1]
                return into
            return self._last[1]
        start = i * self.index.block_bytes
        length = min(self.index.block_bytes, self.record.bytes - start)
        if into is None:
            self._last = None
            buf = memoryview(self._buffer)[:length]
        else:
            buf = into
        view, done = buf, 0
        while done < length:
            got = os.preadv(self.fd, [view[done:]], start + done)
            if not got:
                raise GenerationDamaged(f"file shrank while reading ({self.record.bytes} bytes expected)")
            done += got
        digest = StreamingDigest()
        digest.update(buf)
        if digest.hexdigest() != self.index.digests[i]:
            raise GenerationDamaged(
                f"block {i} (bytes {start}..{start + length}) digest mismatch (content changed or corrupted)"
            )
        if i == self._next:
            self._whole.update(buf)
            self._next += 1
        if into is None:
            self._last = (i, buf)
        return buf

    def whole_digest(self) -> str | None:
        """The whole file's digest, when every block was read in file order (else None)."""
        return self._whole.hexdigest() if self._next == len(self.index.digests) else None

    def will_need(self, spans: Iterable[tuple[int, int]]) -> None:
        """`will_need` on this file: its blocks under the byte spans `[begin, end)` are read next."""
        will_need(self.fd, self.record, spans)

    def read(self, begin: int, end: int, out: memoryview) -> None:
        """Copy bytes `[begin, end)` into `out`, every block they touch verified: a block wholly
        inside them is read straight into its place in `out` and verified there (one copy of each
        byte, the kernel's); only the first and last, cut, pass through the reused buffer."""
        block_bytes = self.index.block_bytes
        pos = begin
        while pos < end:
            i = pos // block_bytes
            offset = pos - i * block_bytes
            take = min(end, (i + 1) * block_bytes) - pos
            if offset == 0 and take == min(block_bytes, self.record.bytes - pos):
                self.block(i, out[pos - begin : pos - begin + take])
            else:
                buf = self.block(i)
                out[pos - begin : pos - begin + take] = memoryview(buf)[offset : offset + take]
            pos += take


def read_ranges(
    path: Path,
    record: FileRecord,
    wanted: Iterable[ElementRange],
    *,
    check_only: Iterable[ElementRange] = (),
    allocate=large_buffer,
) -> tuple[dict[ElementRange, torch.Tensor], dict[str, str]]:
    """Read only the blocks that hold `wanted` and `check_only` (element ranges of flattened
    tensors), each block's digest checked against the manifest's block index, the header parsed
    strictly and checked against that index, and every floating value read checked finite. When
    the ranges cover every block of the file (a same-layout DistributedOptimizer load reads its
    slice file so), its whole-file digest is checked as well, as a whole read checks it.

    Returns `({range of wanted: a fresh 1-D tensor}, the file's safetensors metadata)`; the ranges
    of `check_only` are verified the same way and not returned: they share one buffer, reused from
    range to range. A strided range of `wanted` (`strided_rows`) is read whole into that buffer,
    its blocks verified, and its rows copied out into a fresh tensor of their own (only the rows
    are checked finite). Memory: the returned tensors, the largest range of `check_only` or
    strided range, and one block.
    `allocate(nbytes)` gives each returned range its buffer (default: a fresh `large_buffer`).
    All ranges are read in file order. A record without a block index cannot be read partially
    (ValueError).
    """
    if record.blocks is None:
        raise GenerationDamaged("the manifest records no block digests for it: it can only be read whole")
    import torch

    from miles_lora_ckpt.core.global_layout import strided_view  # with torch: imported where it is used

    fd, st = open_checked(Path(path))
    try:
        if st.st_size != record.bytes:
            raise GenerationDamaged(f"size is {st.st_size} bytes, manifest says {record.bytes}")
        index = record.blocks
        source = _BlockFile(fd, record)
        if index.data_start < 8:
            raise GenerationDamaged("the manifest's block index puts tensor bytes inside the header length")
        head = bytearray(index.data_start)
        source.read(0, index.data_start, memoryview(head))
        (header_len,) = struct.unpack("<Q", bytes(head[:8]))
        if 8 + header_len != index.data_start:
            raise GenerationDamaged("the safetensors header length disagrees with the manifest's block index")
        metadata, entries = parse_header(bytes(head[8:]), index.data_start, record.bytes)
        check_block_spans(index, entries)
        items = [(tuple(item), True) for item in wanted] + [(tuple(item), False) for item in check_only]
        spans = {item: byte_range(index, item) for item, _ in items}
        source.will_need(spans.values())
        # one reused buffer for the spans of the strided ranges kept (their rows are then copied
        # out, compact: the elements between rows are verified with their blocks, never kept), and
        # for the ranges verified and not kept, which pass through it a block at a time
        strided = [e - b for item, kept in items if kept and strided_rows(item) is not None for b, e in [spans[item]]]
        checked = [min(e - b, index.block_bytes) for item, kept in items if not kept for b, e in [spans[item]]]
        scratch = large_buffer(max(strided + checked, default=0))
        out = {}
        for item, kept in sorted(items, key=lambda entry: spans[entry[0]]):
            begin, end = spans[item]
            tag = index.tensors[item[0]][0]
            dtype, itemsize = getattr(torch, DTYPES[tag][0]), DTYPES[tag][1]
            if not kept:
                _check_by_blocks(source, begin, end, dtype, itemsize, tag in FLOAT_TAGS, item[0], scratch)
                continue
            rows = strided_rows(item)
            buf = allocate(end - begin) if kept and rows is None else memoryview(scratch)[: end - begin]
            source.read(begin, end, memoryview(buf))
            tensor = torch.frombuffer(buf, dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
            if rows is not None:  # the rows, one after the other, into a buffer of their own
                step, width, n = rows
                compact = torch.frombuffer(allocate(n * width * itemsize), dtype=dtype)
                compact.view(n, width).copy_(strided_view(tensor, tensor.numel(), 0, step, width, n))
                tensor = compact
            if tag in FLOAT_TAGS and not all_finite(tensor):
                raise GenerationDamaged(f"tensor {item[0]!r} holds NaN or Inf")
            if kept:
                out[item] = tensor
        whole = source.whole_digest()
        if whole is not None and whole != record.digest:  # every byte read: the file digest is checked too
            raise GenerationDamaged("digest mismatch (content changed or corrupted)")
        return out, metadata
    finally:
        os.close(fd)


def _check_by_blocks(source: _BlockFile, begin: int, end: int, dtype, itemsize: int, floating: bool, name, scratch):
    """Verify bytes `[begin, end)` of one tensor (whole elements), not kept: a block at a time through
    `scratch` (each piece ends at a block's end, so whole blocks are read straight into it), every
    floating element checked finite. Memory: one block, however long the range."""
    import torch  # imported where it is used: the core imports torch only when a tensor is touched

    block, pos = source.index.block_bytes, begin
    while pos < end:
        boundary = (pos // block + 1) * block  # the end of the block `pos` lies in
        stop = end if boundary >= end else pos + max(itemsize, (boundary - pos) // itemsize * itemsize)
        view = memoryview(scratch)[: stop - pos]
        source.read(pos, stop, view)
        if floating and not all_finite(torch.frombuffer(view, dtype=dtype)):
            raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
        pos = stop


def check_blocks(path: Path, record: FileRecord, blocks: Iterable[int]) -> None:
    """Verify the digests of some blocks of a file (the share of a partially read file that no
    reader reads), and that the floating elements lying wholly inside them are finite."""
    if record.blocks is None:
        raise GenerationDamaged("the manifest records no block digests for it")
    import torch  # imported where it is used: the core imports torch only when a tensor is touched

    fd, st = open_checked(Path(path))
    try:
        if st.st_size != record.bytes:
            raise GenerationDamaged(f"size is {st.st_size} bytes, manifest says {record.bytes}")
        index = record.blocks
        source = _BlockFile(fd, record)
        chosen = sorted(set(blocks))
        source.will_need((i * index.block_bytes, (i + 1) * index.block_bytes) for i in chosen)
        for i in chosen:
            buf = source.block(i)
            start, end = i * index.block_bytes, i * index.block_bytes + len(buf)
            for name, (tag, begin, stop) in index.tensors.items():
                if tag not in FLOAT_TAGS or stop <= start or begin >= end:
                    continue
                itemsize = DTYPES[tag][1]
                lo = begin + -(-(max(begin, start) - begin) // itemsize) * itemsize
                hi = begin + (min(stop, end) - begin) // itemsize * itemsize
                if hi > lo:
                    part = torch.frombuffer(
                        buf, dtype=getattr(torch, DTYPES[tag][0]), count=(hi - lo) // itemsize, offset=lo - start
                    )
                    if not all_finite(part):
                        raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
    finally:
        os.close(fd)
