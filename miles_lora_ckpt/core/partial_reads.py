"""Verified partial reads: only the blocks of a file that hold the element ranges asked for.

A file written with block digests (`save_tensors(blocks=True)`) can be read in part. `read_ranges`
reads and verifies only the blocks under the ranges asked; `check_blocks` verifies blocks no reader
reads. An element range is `(name, first, stop)` of a flattened tensor or, strided,
`(name, first, stop, step, width)`, whose rows are returned compact.
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
# (name, first, end, step, width): the rows `first + i * step + [0, width)` (`strided_rows`).
ElementRange = tuple


def strided_rows(wanted: ElementRange) -> tuple[int, int, int] | None:
    """`(step, width, n)` of a strided element range `(name, first, stop, step, width)`.

    Row `i` of its `n` rows is `[first + i * step, first + i * step + width)`; the last ends at
    `stop`. None for a plain range `(name, first, stop)`; ValueError for any other shape. A read
    verifies every block under `[first, stop)` but returns only the rows, one after the other.
    """
    if len(wanted) == 3:
        return None
    if len(wanted) != 5 or not all(type(v) is int for v in wanted[1:]):
        raise ValueError(f"an element range is (name, first, stop) or (name, first, stop, step, width), not {wanted!r}")
    _, first, stop, step, width = wanted
    if width <= 0 or step < width or stop - first < width or (stop - first - width) % step:
        raise ValueError(f"strided element range {wanted!r}: rows of {width} every {step} do not end at {stop}")
    return step, width, (stop - first - width) // step + 1


def range_numel(wanted: ElementRange) -> int:
    """How many elements a read of `wanted` returns: `stop - first`, or a strided range's rows'.

    Raises ValueError as `strided_rows` does.
    """
    rows = strided_rows(wanted)
    return wanted[2] - wanted[1] if rows is None else rows[1] * rows[2]


def cut_range(flat, wanted: ElementRange):
    """Elements `wanted` of `flat`, which holds elements `[first, stop)` of `wanted`'s tensor.

    That is `flat` itself for a plain range, or a new compact tensor of the rows for a strided one.
    """
    from miles_lora_ckpt.core.global_layout import strided_view  # torch: imported where it is used

    rows = strided_rows(wanted)
    if rows is None:
        return flat
    step, width, n = rows
    return strided_view(flat, flat.numel(), 0, step, width, n).reshape(-1).clone()


def byte_range(index: BlockIndex, wanted: ElementRange) -> tuple[int, int]:
    """The absolute bytes `[begin, end)` of element range `wanted`, from the manifest's block index.

    A range the file does not hold raises GenerationDamaged; a malformed one, ValueError.
    """
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
    """`(torch dtype name, element count)` of tensor `name` in the manifest's block index, or None.

    The header must agree with the index; `read_ranges` checks that.
    """
    if name not in index.tensors:
        return None
    tag, begin, end = index.tensors[name]
    torch_name, itemsize = DTYPES[tag]
    return torch_name, (end - begin) // itemsize


def blocks_needed(index: BlockIndex, wanted: Iterable[ElementRange]) -> set[int]:
    """The blocks a partial read of `wanted` reads and verifies: the header's and every range's.

    Raises as `byte_range` does.
    """
    needed = set(index.blocks_for(0, index.data_start))
    for item in wanted:
        needed.update(index.blocks_for(*byte_range(index, item)))
    return needed


def mark_blocks(index: BlockIndex, wanted: Iterable[ElementRange], touched: bytearray) -> None:
    """Set `touched[i]` for every block `i` an element range of `wanted` touches.

    Those are the blocks `blocks_needed` names, less the header's. It makes one pass without sorting
    or merging, for the many short ranges of a resharding load. A range the file does not hold
    raises GenerationDamaged, as `byte_range` does.
    """
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
    """Verified random access to one open file, block by block; only the last block is kept.

    Blocks read in file order from block 0, none skipped, also feed the whole file's digest. A
    reader that reads every block so checks the file digest too (`whole_digest`), at no extra cost.
    """

    def __init__(self, fd: int, record: FileRecord):
        self.fd, self.record, self.index = fd, record, record.blocks
        self._last: tuple[int, memoryview] | None = None
        self._whole, self._next = StreamingDigest(), 0
        self._buffer = large_buffer(min(self.index.block_bytes, record.bytes))  # reused for every block

    def block(self, i: int, into: memoryview | None = None) -> memoryview:
        """Block `i`, read and its digest checked; GenerationDamaged on a mismatch.

        It lands in `into` when given, exactly the block's length, so the bytes are copied nowhere
        else. Otherwise it lands in the reused buffer and is kept as the last block.
        """
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
        """`will_need` on this file: its blocks under the byte spans `[begin, end)` come next."""
        will_need(self.fd, self.record, spans)

    def read(self, begin: int, end: int, out: memoryview) -> None:
        """Copy bytes `[begin, end)` into `out`, verifying every block they touch.

        A block wholly inside is read straight into its place in `out`, so the kernel's copy is the
        only one. Only the cut first and last blocks pass through the reused buffer.
        """
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


def _open_indexed(path: Path, record: FileRecord, why_whole: str | None = None) -> tuple[int, _BlockFile]:
    """Open the file at `path` for block reads by `record`'s block index: its descriptor (the
    caller closes it) and its `_BlockFile`. Raises GenerationDamaged where the record has no block
    index (`why_whole` says what that means to the caller) or the file's size is not the record's."""
    if record.blocks is None:
        suffix = f": {why_whole}" if why_whole else ""
        raise GenerationDamaged(f"the manifest records no block digests for it{suffix}")
    fd, st = open_checked(Path(path))
    try:
        if st.st_size != record.bytes:
            raise GenerationDamaged(f"size is {st.st_size} bytes, manifest says {record.bytes}")
        return fd, _BlockFile(fd, record)
    except BaseException:
        os.close(fd)
        raise


def read_ranges(
    path: Path,
    record: FileRecord,
    wanted: Iterable[ElementRange],
    *,
    check_only: Iterable[ElementRange] = (),
    allocate=large_buffer,
) -> tuple[dict[ElementRange, torch.Tensor], dict[str, str]]:
    """Read only the blocks of the file at `path` that hold `wanted` and `check_only`.

    Each block's digest is checked against `record`'s block index, the header against that index,
    and every floating value read is checked finite. When every block is read, the file digest is
    checked too. Returns `({range of wanted: a fresh 1-D tensor}, the file's metadata)`.

    `check_only` ranges are verified the same way through one reused buffer, and not returned. A
    strided range is read whole into that buffer and its rows copied out. `allocate(nbytes)` gives
    each returned range its buffer. Raises GenerationDamaged for any refusal, including a record
    without a block index.
    """
    import torch

    from miles_lora_ckpt.core.global_layout import strided_view  # with torch: imported where it is used

    fd, source = _open_indexed(path, record, "it can only be read whole")
    try:
        index = record.blocks
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
        # One reused buffer for the strided ranges kept, whose rows are then copied out compact,
        # and for the ranges verified and not kept, which pass through it a block at a time.
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
            buf = allocate(end - begin) if rows is None else memoryview(scratch)[: end - begin]
            source.read(begin, end, memoryview(buf))
            tensor = torch.frombuffer(buf, dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
            if rows is not None:  # the rows, one after the other, into a buffer of their own
                step, width, n = rows
                compact = torch.frombuffer(allocate(n * width * itemsize), dtype=dtype)
                compact.view(n, width).copy_(strided_view(tensor, tensor.numel(), 0, step, width, n))
                tensor = compact
            if tag in FLOAT_TAGS and not all_finite(tensor):
                raise GenerationDamaged(f"tensor {item[0]!r} holds NaN or Inf")
            out[item] = tensor
        whole = source.whole_digest()
        if whole is not None and whole != record.digest:  # every byte read: the file digest is checked too
            raise GenerationDamaged("digest mismatch (content changed or corrupted)")
        return out, metadata
    finally:
        os.close(fd)


def _check_by_blocks(source: _BlockFile, begin: int, end: int, dtype, itemsize: int, floating: bool, name, scratch):
    """Verify bytes `[begin, end)` of one tensor without keeping them, a block at a time.

    Each piece ends at a block's end, so whole blocks are read straight into `scratch`. Floating
    elements are checked finite. Memory: one block, however long the range.
    """
    import torch  # the core imports torch only when a tensor is touched

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
    """Verify the digests of `blocks` of the file at `path`, and their floating elements finite.

    These are the blocks of a partially read file that no reader reads. Raises GenerationDamaged
    for any refusal.
    """
    import torch  # the core imports torch only when a tensor is touched

    fd, source = _open_indexed(path, record)
    try:
        index = record.blocks
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
