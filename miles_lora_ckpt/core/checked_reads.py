"""Whole-file checks: one file read once, front to back, with every check its kind needs.

`check_file` refuses anything but a regular file unopened, hashes every byte, and checks a
safetensors file (strict header, every floating tensor finite) or a JSON file (`bounded`'s limits).
With `keep=False` one slice is in memory; `keep=True` keeps the whole file for zero-copy tensors,
once it is known to fit in this host's memory.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.file_reader import FileReader, open_checked
from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.core.host_memory import CHECK_MEMORY_ABOVE, SLICE_BYTES, ensure_allocatable
from miles_lora_ckpt.core.json_files import parse_json
from miles_lora_ckpt.core.layout import FileRecord
from miles_lora_ckpt.core.safetensors_format import (
    DTYPES,
    FLOAT_TAGS,
    check_block_spans,
    check_header_length,
    parse_header,
    tensors_from_buffer,
)

if TYPE_CHECKING:
    import torch

__all__ = ["CheckedFile", "check_file", "load_tensors"]


@dataclass
class CheckedFile:
    """One file read and checked by `check_file`."""

    size: int
    buffer: bytearray | None = None  # the whole file, with keep=True and always for JSON
    metadata: dict[str, str] | None = None  # safetensors `__metadata__`
    entries: dict[str, tuple[str, list[int], int, int]] | None = None  # safetensors tensors
    value: Any = None  # parsed JSON

    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over the kept buffer; ValueError if none was kept."""
        if self.buffer is None or self.entries is None:
            raise ValueError("not a safetensors file read with keep=True")
        return tensors_from_buffer(self.buffer, self.entries)


def check_file(path: Path, record: FileRecord | None = None, *, keep: bool = True) -> CheckedFile:
    """Read the file at `path` once and check it; returns the `CheckedFile`.

    Size and digest are checked against `record` when given. By its suffix, a safetensors file needs
    a strict header and finite floats; a JSON file must be strict, bounded JSON. `keep=False` holds
    one slice in memory. Raises GenerationDamaged (a ValueError) or OSError with the reason.
    """
    path = Path(path)
    kind = "safetensors" if path.name.endswith(".safetensors") else "json" if path.name.endswith(".json") else "raw"
    fd, st = open_checked(path)
    try:
        size = st.st_size
        if record is not None and size != record.bytes:
            raise GenerationDamaged(f"size is {size} bytes, manifest says {record.bytes}")
        if kind == "json" and size > bounded.MAX_JSON_BYTES:
            raise GenerationDamaged(f"JSON file is {size} bytes, more than the {bounded.MAX_JSON_BYTES} allowed")
        keep = keep or kind == "json"
        if keep:
            if kind == "safetensors" and size >= CHECK_MEMORY_ABOVE:
                _precheck_header(fd, size)  # damage is named as damage, whatever memory this host has
            ensure_allocatable(size)
        block_bytes = record.blocks.block_bytes if record is not None and record.blocks is not None else None
        reader = FileReader(fd, size, keep=keep, block_bytes=block_bytes, anonymous=kind == "safetensors")
        try:
            checked = CheckedFile(size)
            if kind == "safetensors":
                checked.metadata, checked.entries = _read_safetensors(reader)
                if record is not None and record.blocks is not None:
                    check_block_spans(record.blocks, checked.entries)
            else:
                reader.skip_rest()
            reader.finish(record)
        finally:
            reader.close()
        checked.buffer = reader.buffer
        if kind == "json":
            checked.value = parse_json(reader.buffer, what=path.name)
        return checked
    finally:
        os.close(fd)


def _precheck_header(fd: int, size: int) -> None:
    """Parse a safetensors header (read with `pread`, not hashed) before a large file is kept whole.

    A sparse or grown file that its header does not describe is refused for that, as `verify` would.
    Otherwise it would be refused for the memory it takes.
    """
    if size < 8:
        return
    head = os.pread(fd, 8, 0)
    if len(head) < 8:  # shrank since its stat: damage, not a struct error
        raise GenerationDamaged(f"file shrank while reading ({size} bytes expected)")
    (header_len,) = struct.unpack("<Q", head)
    check_header_length(header_len, size)
    raw = os.pread(fd, header_len, 8)
    if len(raw) == header_len:
        parse_header(raw, 8 + header_len, size)


def _read_safetensors(reader: FileReader) -> tuple[dict[str, str], dict]:
    import torch  # the core imports torch only when a tensor is touched

    if reader.size < 8:
        raise GenerationDamaged(f"too short for a safetensors file ({reader.size} bytes)")
    (header_len,) = struct.unpack("<Q", reader.read(8))
    check_header_length(header_len, reader.size)
    header = bytes(reader.read(header_len))
    metadata, entries = parse_header(header, 8 + header_len, reader.size)
    for name, (tag, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2]):
        torch_name, itemsize = DTYPES[tag]
        step = SLICE_BYTES - SLICE_BYTES % itemsize
        remaining = end - begin
        while remaining:
            view = reader.read(min(step, remaining))
            remaining -= len(view)
            if tag in FLOAT_TAGS and not all_finite(torch.frombuffer(view, dtype=getattr(torch, torch_name))):
                raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
    return metadata, entries


def load_tensors(path: Path, record: FileRecord | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read and check a safetensors file (size, digest, header, finite floats); zero-copy tensors.

    Also returns its `__metadata__`. Raises as `check_file` does, and ValueError for another suffix.
    """
    checked = check_file(Path(path), record, keep=True)
    if checked.entries is None:
        raise ValueError(f"{path} is not a .safetensors file")
    return checked.tensors(), checked.metadata
