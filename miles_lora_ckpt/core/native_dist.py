"""Recognise and read a stock Miles native (raw-mode) LoRA checkpoint, data only.

Miles' native LoRA (`miles_plugins/lora`, PR #1792; contract §10.6) writes its adapters, and with
an optimizer its optimizer state, as ONE megatron-core `dist_checkpointing` checkpoint in
`<adapter dir>/torch_dist`. Its `.metadata` is a pickle of torch's DCP dataclasses, read here by
the plugin's own data-only reader (`core.dcp_metadata`: no code runs, an allowlist of types); its
tensors are `torch.save`d chunks inside the `*.distcp` files, read by byte range with
`torch.load(weights_only=True)` (`read_chunk`). Its common state (megatron-core 0.16: a
`torch.save`d `common.pt`; 0.19: BYTE_IO items inside the DCP files) is a pickle and never read.

Pointed at one through a load path (`--lora-adapter-path`), the single-LoRA load warm-starts the
adapter weights from it (`savers.single_lora.native_warm`); a `--load`/`--save` directory that
holds one and no plugin generation is still refused (`refusal`): resuming a run needs the
optimizer state the plugin does not restore from it.

Recognition inspects only file names and megatron's own `metadata.json` (plain JSON, read through
`regular_files`: a FIFO, device, socket or link where it or `.metadata` is expected is refused at once,
naming it, never opened); nothing is imported from megatron.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.dcp_metadata import Chunk, Metadata, TensorEntry
from miles_lora_ckpt.core.regular_files import file_kind, open_regular, read_regular

NATIVE_SUBDIR = "torch_dist"  # where Miles' native LoRA puts its checkpoint inside the adapter dir
_MEGATRON_METADATA = "metadata.json"  # megatron-core dist_checkpointing: {"sharded_backend": ...}
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint: the pickled global metadata
_METADATA_LIMIT = 1 << 16  # megatron's metadata.json is a few hundred bytes


def is_dist_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a megatron-core `dist_checkpointing` checkpoint directory: its
    `metadata.json` names a `sharded_backend`, or it holds torch DCP's `.metadata` and
    `*.distcp` files. An unreadable or unparsable entry counts as not one; a special file (FIFO,
    device, socket, directory, link) named `metadata.json` or `.metadata` raises ValueError naming
    it, at once and without opening it (opening a FIFO would block)."""
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
    """Raise ValueError naming `path` unless it is a regular file (judged from `lstat`, not opened);
    a path that vanished passes (the read that follows says so)."""
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
    """Megatron's `metadata.json` in `directory` parsed (bounded, never blocking), or None when it is
    missing, unreadable or not JSON; ValueError naming it when it is a special file."""
    file = Path(directory) / _MEGATRON_METADATA
    _require_regular(file)
    try:
        return bounded.parse_json(read_regular(file, max_bytes=_METADATA_LIMIT), what=str(file))
    except (OSError, ValueError):
        return None


def find_native_checkpoint(path: str | os.PathLike) -> Path | None:
    """The stock native adapter checkpoint `path` stands for: `path` itself when it is a
    `dist_checkpointing` directory named `torch_dist`, or `path/torch_dist` (Miles' adapter dir).
    None otherwise: a Megatron base-model checkpoint (`iter_NNNNNNN/`, also dist_checkpointing,
    e.g. raw mode's `--ref-load`) is not an adapter checkpoint and is never matched. ValueError
    naming a special file where a metadata file is expected (`is_dist_checkpoint_dir`)."""
    path = Path(path)
    for candidate in (path, path / NATIVE_SUBDIR):
        if candidate.name == NATIVE_SUBDIR and is_dist_checkpoint_dir(candidate):
            return candidate
    return None


def backend_of(directory: Path) -> str:
    """The `sharded_backend` megatron recorded in `directory/metadata.json`, or 'torch_dist'
    (ValueError naming the file when it is a special file)."""
    metadata = _megatron_metadata(Path(directory))
    backend = metadata.get("sharded_backend") if isinstance(metadata, dict) else None
    return backend[:64] if isinstance(backend, str) else NATIVE_SUBDIR


def refusal(path: str | os.PathLike, found: Path) -> str:
    """The error text for a `--load`/`--save` directory holding a stock native checkpoint and no
    plugin generation: which directory, what it is, why the plugin does not resume from it, and
    what to do instead."""
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
    """One saved chunk of tensor item `name`: its byte range of its `*.distcp` file (from
    `metadata.storage`), loaded with `torch.load(weights_only=True)` (never a fallback), checked to
    be a tensor of the chunk's sizes and the item's dtype. Raises ValueError or OSError naming the
    file."""
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
    """Stock native adapter checkpoints a Miles `--save`/`--load` directory holds (each a
    `torch_dist` directory, see `find_native_checkpoint`): in the directory itself, and in each
    `iter_NNNNNNN` directory or its `adapter` subdirectory (where Miles' LoRA save puts the
    adapter). Sorted. Raises only ValueError naming a special file where a metadata file is
    expected (`is_dist_checkpoint_dir`)."""
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
