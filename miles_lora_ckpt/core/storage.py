"""Where bytes go: crash-safe files, our own streaming safetensors writer, and a strict reader.

Every file is written under a temporary name, fsynced, then renamed; the digest is computed on
the bytes as they are written, so a file is read back only by readers. Tensors are safetensors
(readable by the `safetensors` library as is), everything else JSON. Nothing here unpickles.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from miles_lora_ckpt.core.digest import StreamingDigest
from miles_lora_ckpt.core.layout import FileRecord

if TYPE_CHECKING:
    import torch

# safetensors dtype tag -> (torch dtype name, item size)
_DTYPES = {
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
_TAG_OF = {torch_name: tag for tag, (torch_name, _) in _DTYPES.items()}
_FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


# --------------------------------------------------------------------------- plain files


def write_file_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> FileRecord:
    """Write `chunks` to `path` via temp name + fsync + rename; returns size and digest."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    digest = StreamingDigest()
    size = 0
    try:
        with open(tmp, "xb", buffering=0) as handle:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                digest.update(view)
                size += len(view)
                while view:
                    written = handle.write(view)
                    view = view[written:]
            os.fsync(handle.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return FileRecord(bytes=size, digest=digest.hexdigest())


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file_verified(path: Path, record: FileRecord | None = None) -> bytearray:
    """Read a whole file in one pass; check size and digest against `record` when given."""
    path = Path(path)
    size = os.stat(path).st_size
    if record is not None and size != record.bytes:
        raise ValueError(f"size is {size} bytes, manifest says {record.bytes}")
    buf = bytearray(size)
    with open(path, "rb", buffering=0) as handle:
        view = memoryview(buf)
        while view:
            got = handle.readinto(view)
            if not got:
                raise ValueError(f"file shrank while reading ({size} bytes expected)")
            view = view[got:]
    if record is not None:
        digest = StreamingDigest()
        digest.update(buf)
        if digest.hexdigest() != record.digest:
            raise ValueError("digest mismatch (content changed or corrupted)")
    return buf


def json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()


def write_json(path: Path, obj) -> FileRecord:
    return write_file_atomic(path, [json_bytes(obj)])


def parse_json(raw: bytes | bytearray):
    """Strict JSON: no NaN/Infinity constants."""

    def _reject(name):
        raise ValueError(f"non-finite JSON constant {name}")

    try:
        return json.loads(bytes(raw), parse_constant=_reject)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None


def read_json(path: Path, record: FileRecord | None = None):
    return parse_json(read_file_verified(path, record))


# --------------------------------------------------------------------------- safetensors


def save_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    *,
    metadata: dict[str, str] | None = None,
    finite: bool = False,
) -> FileRecord:
    """Stream `tensors` into a safetensors file without building it in memory first.

    With `finite=True` every floating tensor must be finite (raises ValueError naming it) and the
    manifest will ask verification to check that again.
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    bodies = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        tag = _TAG_OF.get(str(tensor.dtype).removeprefix("torch."))
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors tag")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": tag, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        bodies.append(_slices(name, tensor, check_finite=finite and tag in _FLOAT_TAGS))
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    chunks = itertools.chain([struct.pack("<Q", len(header_bytes)), header_bytes], *bodies)
    record = write_file_atomic(path, chunks)
    return FileRecord(bytes=record.bytes, digest=record.digest, finite=finite)


SLICE_BYTES = 4 * 1024 * 1024


def _slices(name: str, tensor: torch.Tensor, *, check_finite: bool):
    """The tensor's bytes in cache-sized slices, each checked for finiteness just before it is
    hashed and written, so the data crosses memory once instead of once per pass."""
    flat = tensor.reshape(-1)
    step = max(1, SLICE_BYTES // max(1, tensor.element_size()))
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        if check_finite and not _all_finite(part):
            raise ValueError(f"tensor {name!r} holds NaN or Inf; refusing to checkpoint it")
        yield _byte_view(part)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(_torch().uint8).numpy())


def _all_finite(tensor: torch.Tensor) -> bool:
    # A sum is finite only if every term is (NaN and Inf propagate): one vectorised pass with no
    # temporary. Only a non-finite sum, which may also be an overflow of finite values, pays for
    # the exact element-wise check.
    if tensor.numel() == 0:
        return True
    if math.isfinite(tensor.sum().item()):
        return True
    return bool(_torch().isfinite(tensor).all())


def parse_safetensors_header(
    buf: bytes | bytearray,
) -> tuple[dict[str, str], dict[str, tuple[str, list[int], int, int]]]:
    """Strictly parse a safetensors buffer's header.

    Returns `(metadata, {name: (dtype_tag, shape, begin, end)})` with offsets absolute in `buf`.
    Raises ValueError for anything the format forbids: a header past the end, unknown dtypes,
    sizes that do not match shapes, gaps, overlaps or bytes not covered by any tensor.
    """
    if len(buf) < 8:
        raise ValueError(f"too short for a safetensors file ({len(buf)} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(buf[:8]))
    if header_len > min(MAX_HEADER_BYTES, len(buf) - 8):
        raise ValueError(f"safetensors header length {header_len} exceeds the file (not safetensors?)")
    try:
        header = json.loads(bytes(buf[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("safetensors __metadata__ must map strings to strings")
    data_start = 8 + header_len
    entries = {name: _parse_entry(name, spec, data_start) for name, spec in header.items()}
    _check_coverage(entries, data_start, len(buf))
    return metadata, entries


def _parse_entry(name: str, spec, data_start: int) -> tuple[str, list[int], int, int]:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r}: malformed header entry")
    tag, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if tag not in _DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {tag!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ValueError(f"tensor {name!r}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * _DTYPES[tag][1] or begin < 0:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes do not hold {tag}{shape}")
    return tag, shape, data_start + begin, data_start + end


def _check_coverage(entries: dict, data_start: int, total: int) -> None:
    cursor = data_start
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin != cursor:
            raise ValueError(f"tensor {name!r}: gap or overlap at byte {begin} (expected {cursor})")
        cursor = end
    if cursor != total:
        raise ValueError(f"data section ends at byte {cursor} but the file has {total}")


def tensors_from_buffer(
    buf: bytearray, entries: dict[str, tuple[str, list[int], int, int]], *, require_finite: bool = False
) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over `buf` (they keep it alive); optionally refuse non-finite floats."""
    torch = _torch()
    tensors = {}
    for name, (tag, shape, begin, end) in entries.items():
        dtype = getattr(torch, _DTYPES[tag][0])
        if end == begin:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            count = (end - begin) // _DTYPES[tag][1]
            tensor = torch.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(shape)
        if require_finite and tag in _FLOAT_TAGS and not _all_finite(tensor):
            raise ValueError(f"tensor {name!r} holds NaN or Inf")
        tensors[name] = tensor
    return tensors


def load_tensors(path: Path, record: FileRecord | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read, verify (size, digest, header, finiteness if the record asks) and map a safetensors file."""
    buf = read_file_verified(path, record)
    metadata, entries = parse_safetensors_header(buf)
    finite = record.finite if record is not None else False
    return tensors_from_buffer(buf, entries, require_finite=finite), metadata


def _torch():
    import torch

    return torch
