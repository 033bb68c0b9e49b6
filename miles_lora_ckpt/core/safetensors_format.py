"""The safetensors format as this package writes and reads it: dtype tags, limits, a strict parser.

`parse_header` parses a header strictly within the bounds below, and every refusal is damage.
`check_block_spans` holds it against a manifest's block index; `tensors_from_buffer` gives zero-copy
tensors over a file's bytes.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.layout import BlockIndex

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "FLOAT_TAGS",
    "MAX_DIM",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_DEPTH",
    "MAX_STRIDE",
    "MAX_TENSOR_NAME",
    "MAX_TENSOR_RANK",
    "TAG_OF",
    "check_block_spans",
    "check_header_length",
    "check_tensor_name",
    "parse_header",
    "parse_safetensors_header",
    "tensors_from_buffer",
]

# Safetensors dtype tag -> (torch dtype name, item size).
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
TAG_OF = {torch_name: tag for tag, (torch_name, _) in DTYPES.items()}
FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}
# The one limit on a safetensors header's JSON, in bytes: the safetensors library's own. So the
# library reads every file we write, and we read no header it would refuse.
MAX_HEADER_BYTES = 100_000_000
MAX_HEADER_DEPTH = 4  # {name: {"shape": [...]}} and {"__metadata__": {...}}
MAX_TENSOR_RANK = 32
MAX_DIM = 2**48
MAX_STRIDE = 2**62  # every stride (product of trailing dims) must fit torch's int64 sizes
MAX_TENSOR_NAME = 1024
_PATH_CHARACTERS = ("/", "\\")


def parse_safetensors_header(
    buf: bytes | bytearray,
) -> tuple[dict[str, str], dict[str, tuple[str, list[int], int, int]]]:
    """Strictly parse the header of a whole safetensors file held in `buf`.

    Returns `(metadata, {name: (dtype_tag, shape, begin, end)})` with offsets absolute in `buf`.
    Raises GenerationDamaged (a ValueError) for anything the format forbids. That includes a header
    past the end or nested too deep, unknown dtypes, bad dimensions, and sizes that do not match
    shapes. Gaps, overlaps and bytes no tensor covers are refused too.
    """
    if len(buf) < 8:
        raise GenerationDamaged(f"too short for a safetensors file ({len(buf)} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(buf[:8]))
    check_header_length(header_len, len(buf))
    return parse_header(bytes(buf[8 : 8 + header_len]), 8 + header_len, len(buf))


def check_header_length(header_len: int, size: int) -> None:
    """Refuse (GenerationDamaged) a header length past `MAX_HEADER_BYTES` or the file's `size`."""
    if header_len > size - 8:
        raise GenerationDamaged(f"safetensors header length {header_len} exceeds the file (not safetensors?)")
    if header_len > MAX_HEADER_BYTES:
        raise GenerationDamaged(
            f"safetensors header length {header_len} is more than the {MAX_HEADER_BYTES} bytes allowed"
        )


def parse_header(raw: bytes, data_start: int, total: int) -> tuple[dict[str, str], dict]:
    """Parse the header JSON `raw` of a file of `total` bytes whose data starts at `data_start`.

    Returns `(metadata, {name: (dtype_tag, shape, begin, end)})` with offsets absolute. Every
    refusal, its own or `bounded`'s, is GenerationDamaged.
    """
    try:
        header = bounded.parse_json(
            raw, what="safetensors header", max_bytes=MAX_HEADER_BYTES, max_depth=MAX_HEADER_DEPTH
        )
        bounded.mapping(header, "safetensors header")
        metadata = header.pop("__metadata__", None) or {}
        try:
            bounded.string_map(metadata, "safetensors __metadata__")
        except ValueError as exc:
            raise ValueError(f"{exc} (it must map strings to strings)") from None
        entries = {name: _parse_entry(name, spec, data_start) for name, spec in header.items()}
        _check_coverage(entries, data_start, total)
    except ValueError as exc:  # a refusal of the file's bytes is damage
        raise GenerationDamaged(str(exc)) from None
    return metadata, entries


def check_tensor_name(name: str) -> None:
    """Check a tensor name in a file we write or read; ValueError if it is refused.

    It has 1 to `MAX_TENSOR_NAME` printable characters, no `/` or `\\`, and is not `.` or `..`.
    Tensor names become file names and path components in exports and tools.
    """
    where = f"tensor {name[:80]!r}"
    if not name or len(name) > MAX_TENSOR_NAME:
        raise ValueError(f"{where}: a tensor name has 1 to {MAX_TENSOR_NAME} characters, this one {len(name)}")
    if any(c in name for c in _PATH_CHARACTERS) or name in (".", "..") or not name.isprintable():
        raise ValueError(f"{where}: the name holds a path or control character (not allowed in a tensor name)")


def _parse_entry(name: str, spec, data_start: int) -> tuple[str, list[int], int, int]:
    check_tensor_name(name)
    where = f"tensor {name[:80]!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise GenerationDamaged(f"{where}: malformed header entry")
    tag, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(tag, str) or tag not in DTYPES:
        raise GenerationDamaged(f"{where}: unsupported dtype {bounded.show(tag)}")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_RANK:
        raise GenerationDamaged(f"{where}: bad shape {bounded.show(shape)}")
    for axis, dim in enumerate(shape):
        bounded.integer(dim, f"{where}: dimension {axis}", high=MAX_DIM)
    if math.prod(max(dim, 1) for dim in shape) > MAX_STRIDE:
        raise GenerationDamaged(f"{where}: the dimensions {shape} overflow a tensor's size")
    if not (isinstance(offsets, list) and len(offsets) == 2):
        raise GenerationDamaged(f"{where}: bad data_offsets {bounded.show(offsets)}")
    begin, end = (bounded.integer(o, f"{where}: data offset", high=MAX_STRIDE) for o in offsets)
    if end < begin or end - begin != math.prod(shape) * DTYPES[tag][1]:
        raise GenerationDamaged(f"{where}: {end - begin} bytes do not hold {tag}{shape}")
    return tag, shape, data_start + begin, data_start + end


def _check_coverage(entries: dict, data_start: int, total: int) -> None:
    cursor = data_start
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin != cursor:
            raise GenerationDamaged(f"tensor {name[:80]!r}: gap or overlap at byte {begin} (expected {cursor})")
        cursor = end
    if cursor != total:
        raise GenerationDamaged(f"data section ends at byte {cursor} but the file has {total}")


def check_block_spans(index: BlockIndex, entries: dict) -> None:
    """Refuse (GenerationDamaged) a block index whose tensor byte ranges are not the header's."""
    found = {name: (tag, begin, end) for name, (tag, _, begin, end) in entries.items()}
    if found != dict(index.tensors):
        raise GenerationDamaged("the safetensors header and the manifest's block index disagree about the tensors")


def tensors_from_buffer(buf: bytearray, entries: dict[str, tuple[str, list[int], int, int]]) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over `buf`, which they keep alive, for the `entries` of a checked file.

    `check_file` checked the floats finite as it read them.
    """
    import torch  # the core imports torch only when a tensor is touched

    tensors = {}
    for name, (tag, shape, begin, end) in entries.items():
        dtype = getattr(torch, DTYPES[tag][0])
        if end == begin:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            count = (end - begin) // DTYPES[tag][1]
            tensor = torch.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(shape)
        tensors[name] = tensor
    return tensors
