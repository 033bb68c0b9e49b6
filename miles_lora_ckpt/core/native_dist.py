"""Recognise a stock Miles native (raw-mode) LoRA checkpoint, which the plugin refuses to read.

Miles' native LoRA (`miles_plugins/lora`, PR #1792; contract §10.6) writes its adapters, and with
an optimizer its optimizer state, as ONE megatron-core `dist_checkpointing` checkpoint in
`<adapter dir>/torch_dist`. Its `.metadata` is a plain pickle of torch's DCP dataclasses and its
common state is a pickle too (megatron-core 0.16: a `torch.save`d `common.pt`; 0.19: inside the
DCP files); the plugin never unpickles, so it does not read that
checkpoint. Pointed at one (`--lora-adapter-path`, `--load`, a load path), the plugin refuses
loudly instead of starting a fresh adapter (`refusal`).

Only file names and megatron's own `metadata.json` (plain JSON) are inspected: nothing is
unpickled, nothing is imported from megatron.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

NATIVE_SUBDIR = "torch_dist"  # where Miles' native LoRA puts its checkpoint inside the adapter dir
_MEGATRON_METADATA = "metadata.json"  # megatron-core dist_checkpointing: {"sharded_backend": ...}
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint: the pickled global metadata
_METADATA_LIMIT = 1 << 16  # megatron's metadata.json is a few hundred bytes


def is_dist_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a megatron-core `dist_checkpointing` checkpoint directory: its
    `metadata.json` names a `sharded_backend`, or it holds torch DCP's `.metadata` and
    `*.distcp` files. Never raises (an unreadable entry counts as not one)."""
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        names = os.listdir(path)
    except OSError:
        return False
    if _DCP_METADATA in names and any(n.endswith(".distcp") for n in names):
        return True
    if _MEGATRON_METADATA not in names:
        return False
    try:
        with open(path / _MEGATRON_METADATA, "rb") as f:
            metadata = json.loads(f.read(_METADATA_LIMIT))
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and "sharded_backend" in metadata


def find_native_checkpoint(path: str | os.PathLike) -> Path | None:
    """The stock native adapter checkpoint `path` stands for: `path` itself when it is a
    `dist_checkpointing` directory named `torch_dist`, or `path/torch_dist` (Miles' adapter dir).
    None otherwise: a Megatron base-model checkpoint (`iter_NNNNNNN/`, also dist_checkpointing,
    e.g. raw mode's `--ref-load`) is not an adapter checkpoint and is never matched."""
    path = Path(path)
    for candidate in (path, path / NATIVE_SUBDIR):
        if candidate.name == NATIVE_SUBDIR and is_dist_checkpoint_dir(candidate):
            return candidate
    return None


def backend_of(directory: Path) -> str:
    """The `sharded_backend` megatron recorded in `directory/metadata.json`, or 'torch_dist'."""
    try:
        with open(Path(directory) / _MEGATRON_METADATA, "rb") as f:
            return str(json.loads(f.read(_METADATA_LIMIT)).get("sharded_backend", NATIVE_SUBDIR))
    except (OSError, ValueError, AttributeError):
        return NATIVE_SUBDIR


def refusal(path: str | os.PathLike, found: Path) -> str:
    """The error text for a load pointed at a stock native checkpoint: which directory, what it
    is, why the plugin does not read it, and what to do instead."""
    return (
        f"{path} is a stock Miles native LoRA checkpoint (megatron-core dist_checkpointing, backend "
        f"{backend_of(found)!r}, in {found}), not a miles-lora-ckpt generation: refusing to load it and refusing to "
        "start a fresh adapter instead. The plugin does not read it because its metadata (.metadata) and common "
        "state (common.pt, or inside the DCP files) are pickles and it never unpickles, and because its tensors are keyed by Miles' native "
        "adapter names. Remedy: keep training from it with stock Miles (--megatron-to-hf-mode raw, without "
        "--custom-megatron-init-path), or start from a miles-lora-ckpt save root or generation, or from a stock "
        "Miles adapter directory of per-rank .pt files (weights-only warm start), or drop this path to train a new "
        "adapter deliberately."
    )


def native_checkpoints_in(directory: str | os.PathLike) -> list[Path]:
    """Stock native adapter checkpoints a Miles `--save`/`--load` directory holds (each a
    `torch_dist` directory, see `find_native_checkpoint`): in the directory itself, and in each
    `iter_NNNNNNN` directory or its `adapter` subdirectory (where Miles' LoRA save puts the
    adapter). Sorted; never raises."""
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
