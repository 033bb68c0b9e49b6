"""The streaming safetensors writer: a file written slice by slice, never built in memory first.

`save_tensors` writes crash-safely, checks floating values finite when asked, and records block
digests for verified partial reads. The files are plain safetensors that the `safetensors` library
reads as they are.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_lora_ckpt.core import atomic_files, safetensors_format
from miles_lora_ckpt.core.digest import BlockDigests
from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.core.host_memory import SLICE_BYTES
from miles_lora_ckpt.core.layout import BlockIndex, FileRecord
from miles_lora_ckpt.core.safetensors_format import DTYPES, FLOAT_TAGS, TAG_OF, check_tensor_name

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_BYTES", "LazyTensor", "save_tensors"]

BLOCK_BYTES = 4 * 1024 * 1024  # block size of files written for partial reads (`save_tensors(blocks=True)`)


@dataclass(frozen=True)
class LazyTensor:
    """A tensor the writer asks for only when its bytes are due.

    `produce()` must return a tensor of `dtype` and `shape`. The writer drops it once written, so a
    file of many lazy tensors holds one of them in memory at a time.
    """

    dtype: Any  # a torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    def produced(self, name: str) -> torch.Tensor:
        """`produce()`'s tensor, checked against the announced dtype and shape.

        A mismatch raises ValueError naming tensor `name`.
        """
        tensor = self.produce()
        if tensor.dtype != self.dtype or tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(
                f"tensor {name!r}: produced {tensor.dtype}{list(tensor.shape)}, announced "
                f"{self.dtype}{list(self.shape)}"
            )
        return tensor


def save_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor | LazyTensor],
    *,
    metadata: dict[str, str] | None = None,
    finite: bool = False,
    blocks: bool = False,
    block_bytes: int | None = None,
) -> FileRecord:
    """Stream `tensors` into a safetensors file at `path`; returns its `FileRecord`.

    Values may be `LazyTensor`s, produced one at a time as the writer reaches them. With
    `finite=True` every floating tensor must be finite. With `blocks=True` the record also holds a
    `BlockIndex` (blocks of `block_bytes`, default `BLOCK_BYTES`) for verified partial reads.
    Raises ValueError naming the tensor (bad name or dtype, NaN or Inf) or for an oversized header;
    an OSError of the write propagates.
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    bodies = []
    offset = 0
    spans = {}
    for name in sorted(tensors):
        check_tensor_name(name)
        spec = tensors[name]
        dtype, shape = (spec.dtype, tuple(spec.shape)) if isinstance(spec, LazyTensor) else (spec.dtype, spec.shape)
        tag = TAG_OF.get(str(dtype).removeprefix("torch."))
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors tag")
        nbytes = math.prod(shape) * DTYPES[tag][1]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (tag, offset, offset + nbytes)
        bodies.append(_slices(name, spec, check_finite=finite and tag in FLOAT_TAGS))
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    limit = safetensors_format.MAX_HEADER_BYTES  # the readers' limit, one number for both
    if len(header_bytes) > limit:
        raise ValueError(
            f"{path.name}: the safetensors header would be {len(header_bytes)} bytes, more than the "
            f"{limit} a reader accepts (too many tensors, or too much metadata, in one file)"
        )
    chunks = itertools.chain([struct.pack("<Q", len(header_bytes)), header_bytes], *bodies)
    digests = BlockDigests(block_bytes or BLOCK_BYTES) if blocks else None
    record = atomic_files.write_file_atomic(path, chunks, blocks=digests)
    record = replace(record, finite=finite)
    if digests is not None:
        start = 8 + len(header_bytes)
        index = {name: (tag, start + begin, start + end) for name, (tag, begin, end) in spans.items()}
        record = replace(record, blocks=BlockIndex(digests.block_bytes, tuple(digests.finish()), index))
    return record


def _slices(name: str, spec, *, check_finite: bool):
    """The tensor's bytes in cache-sized slices, each checked finite just before it is hashed.

    So the data crosses memory once instead of once per pass. A `LazyTensor` is produced here, when
    its turn comes, and released after its last slice.
    """
    tensor = spec.produced(name) if isinstance(spec, LazyTensor) else spec
    tensor = tensor.detach().cpu().contiguous()
    flat = tensor.reshape(-1)
    step = max(1, SLICE_BYTES // max(1, tensor.element_size()))
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        if check_finite and not all_finite(part):
            raise ValueError(f"tensor {name!r} holds NaN or Inf; refusing to checkpoint it")
        yield _byte_view(part)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    import torch  # the core imports torch only when a tensor is touched

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
