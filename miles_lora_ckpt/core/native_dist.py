"""Recognise and read a stock Miles native (raw-mode) LoRA checkpoint, data only.

Miles' native LoRA (`miles_plugins/lora`, PR #1792) writes its adapters, and any optimizer state,
as one megatron-core `dist_checkpointing` checkpoint in `<adapter dir>/torch_dist`. Its pickled
`.metadata` is read by `core.dcp_metadata`, which runs no code. Tensors are read by byte range with
`torch.load(weights_only=True)`. Its common state is a pickle and never read.

The single-LoRA load warm-starts adapter weights from one (`--lora-adapter-path`). A `--load` or
`--save` directory holding one is refused (`refusal`): a resume needs optimizer state the plugin
does not restore from it. Recognition reads only file names and megatron's `metadata.json`.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.dcp_metadata import Chunk, Metadata, TensorEntry
from miles_lora_ckpt.core.regular_files import file_kind, open_regular, read_regular

__all__ = ["NATIVE_SUBDIR", "find_native_checkpoint", "native_checkpoints_in", "read_chunk", "refusal"]

NATIVE_SUBDIR = "torch_dist"  # where Miles' native LoRA puts its checkpoint inside the adapter dir
_MEGATRON_METADATA = "metadata.json"  # megatron-core dist_checkpointing: {"sharded_backend": ...}
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint: the pickled global metadata
_METADATA_LIMIT = 1 << 16  # megatron's metadata.json is a few hundred bytes


def is_dist_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a megatron-core `dist_checkpointing` checkpoint directory.

    It is when its `metadata.json` names a `sharded_backend`, or it holds torch DCP's `.metadata`
    and `*.distcp` files. An unreadable entry counts as not one. A special file named
    `metadata.json` or `.metadata` raises ValueError naming it, unopened, since a FIFO would block.
    """
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        names = os.listdir(path)
    except OSError:
        return False
    for name in (_DCP_METADATA, _MEGATRON_METADATA):
        if name in names:
            _require_regular(path / name)
    if _DCP_METADATA in names and any(n.endswith(".distcp") for n in names):
        return True
    if _MEGATRON_METADATA not in names:
        return False
    metadata = _megatron_metadata(path)
    return isinstance(metadata, dict) and "sharded_backend" in metadata


def _require_regular(path: Path) -> None:
    """Raise ValueError naming `path` unless it is a regular file, judged from `lstat`.

    A path that vanished passes: the read that follows says so.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ValueError(f"{path}: cannot be examined ({exc.strerror}); refusing to read it") from None
    kind = file_kind(mode)
    if kind != "regular file":
        raise ValueError(f"{path} is a {kind}, not a regular file; refusing to read it")


def _megatron_metadata(directory: Path):
    """Megatron's `metadata.json` in `directory`, parsed without blocking, or None.

    None when it is missing, unreadable or not JSON; ValueError naming it when it is a special file.
    """
    file = Path(directory) / _MEGATRON_METADATA
    _require_regular(file)
    try:
        return bounded.parse_json(read_regular(file, max_bytes=_METADATA_LIMIT), what=str(file))
    except (OSError, ValueError):
        return None


def find_native_checkpoint(path: str | os.PathLike) -> Path | None:
    """The stock native adapter checkpoint `path` stands for, or None.

    That is `path` itself when it is a `dist_checkpointing` directory named `torch_dist`, or
    `path/torch_dist`. A Megatron base-model checkpoint (`iter_NNNNNNN/`) is never matched. Raises
    ValueError as `is_dist_checkpoint_dir` does.
    """
    path = Path(path)
    for candidate in (path, path / NATIVE_SUBDIR):
        if candidate.name == NATIVE_SUBDIR and is_dist_checkpoint_dir(candidate):
            return candidate
    return None


def backend_of(directory: Path) -> str:
    """The `sharded_backend` megatron recorded in `directory/metadata.json`, or 'torch_dist'.

    A special file there raises ValueError naming it.
    """
    metadata = _megatron_metadata(Path(directory))
    backend = metadata.get("sharded_backend") if isinstance(metadata, dict) else None
    return backend[:64] if isinstance(backend, str) else NATIVE_SUBDIR


def refusal(path: str | os.PathLike, found: Path) -> str:
    """The error text for a `--load`/`--save` directory `path` holding the stock checkpoint `found`.

    It says what the directory holds, why the plugin does not resume from it, and what to do
    instead. Raises ValueError as `backend_of` does.
    """
    return (
        f"{path} holds a stock Miles native LoRA checkpoint (megatron-core dist_checkpointing, backend "
        f"{backend_of(found)!r}, in {found}), not a miles-lora-ckpt generation: refusing to resume from it and "
        "refusing to start a fresh adapter over it. The plugin restores only its adapter weights (a warm start); "
        "its optimizer moments, step counters and scheduler live in megatron's optimizer items and pickled common "
        "state, which it does not read. Remedy: keep training from it with stock Miles (--megatron-to-hf-mode raw, "
        f"without --custom-megatron-init-path); or warm-start the adapter weights from it with --lora-adapter-path "
        f"{found.parent} and a new --save directory; or start from a miles-lora-ckpt save root or generation."
    )


def read_chunk(directory: Path, metadata: Metadata, name: str, chunk: Chunk) -> torch.Tensor:
    """One saved chunk of tensor item `name`, read from its `*.distcp` file in `directory`.

    Its byte range comes from `metadata.storage`; it is loaded with `torch.load(weights_only=True)`,
    never a fallback. It must be a tensor of the chunk's sizes and the item's dtype. Raises
    ValueError or OSError naming the file.
    """
    entry = metadata.entries.get(name)
    if not isinstance(entry, TensorEntry):
        raise ValueError(f"{directory}: {name!r} is not a tensor item of the checkpoint")
    info = metadata.storage.get((name, chunk.offsets))
    if info is None:
        raise ValueError(f"{directory}/.metadata: no storage entry for {name!r} at {list(chunk.offsets)}")
    file = directory / info.relative_path
    if not info.relative_path.endswith(".distcp") or Path(info.relative_path).name != info.relative_path:
        raise ValueError(f"{directory}/.metadata: {name!r} lies in {info.relative_path!r}, not a .distcp file here")
    if info.transforms:
        raise ValueError(f"{file}: {name!r} is stored with transforms {list(info.transforms)} the plugin does not read")
    itemsize = torch.empty(0, dtype=getattr(torch, entry.dtype)).element_size()
    numel = 1
    for size in chunk.sizes:
        numel *= size
    if info.length > numel * itemsize + _CHUNK_OVERHEAD:
        raise ValueError(f"{file}: {name!r} takes {info.length} bytes, more than its {numel} {entry.dtype} values need")
    try:
        fd, st = open_regular(file)
    except ValueError as exc:  # a FIFO, device, socket or link: refused without opening it, named
        raise ValueError(f"{file}: {exc}; refusing to read {name!r} from it") from None
    try:
        if info.offset + info.length > st.st_size:
            raise ValueError(
                f"{file}: {name!r} at bytes [{info.offset}, +{info.length}) runs past its {st.st_size} bytes"
            )
        data = os.pread(fd, info.length, info.offset)
    finally:
        os.close(fd)
    if len(data) != info.length:
        raise ValueError(f"{file}: {name!r}: read {len(data)} of {info.length} bytes")
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only refusals and damage alike: named, never retried
        raise ValueError(
            f"{file}: {name!r} at byte {info.offset}: torch.load(weights_only=True) refused: {exc}"
        ) from None
    if (
        not isinstance(tensor, torch.Tensor)
        or tuple(tensor.shape) != chunk.sizes
        or tensor.dtype != getattr(torch, entry.dtype)
    ):
        what = f"{tensor.dtype}{list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"{file}: {name!r} at byte {info.offset} holds {what}, the metadata says {entry.dtype}{list(chunk.sizes)}"
        )
    return tensor


_CHUNK_OVERHEAD = 1 << 16  # torch.save's zip container around one tensor's bytes


def native_checkpoints_in(directory: str | os.PathLike) -> list[Path]:
    """The stock native adapter checkpoints a Miles `--save`/`--load` directory holds, sorted.

    It looks in the directory itself, and in each `iter_NNNNNNN` directory or its `adapter`
    subdirectory. Raises only ValueError, naming a special file where a metadata file belongs.
    """
    directory = Path(directory)
    found = [f for f in (find_native_checkpoint(directory),) if f is not None]
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("iter_"))
    except OSError:
        return found
    for name in names:
        for candidate in (directory / name, directory / name / "adapter"):
            hit = find_native_checkpoint(candidate)
            if hit is not None and hit not in found:
                found.append(hit)
    return found
