"""Warm start from a stock Miles adapter directory (`adapter_megatron_rank*.pt`): weights only.

Those files are pickles, so they are read with `torch.load(weights_only=True)` and never with a
fallback. Masters are refreshed from the loaded adapter. Moments and scheduler are not restored,
and the warning says so.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from miles_lora_ckpt.core import file_reader
from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.scheduler import reposition_scheduler
from miles_lora_ckpt.megatron.topology import current_coordinates
from miles_lora_ckpt.megatron.undo import UndoRecord
from miles_lora_ckpt.savers.options import LoadSource
from miles_lora_ckpt.savers.single_lora.common import LoadResult, chunk_count

__all__ = ["warm_start_legacy"]


def warm_start_legacy(consensus: Consensus, model, path: Path, optimizer, scheduler) -> LoadResult:
    """Collective. Load the adapter weights of the stock Miles adapter directory `path`.

    Each rank reads its `adapter_megatron_rank*.pt`. The masters of `optimizer`'s children are
    refreshed from the adapter. `scheduler` is repositioned to the saved iteration, where the
    directory records one. Returns the `LoadResult`, with a warning naming what was not restored.
    Raises the same CheckpointError on every rank, after undoing any change.
    """
    children = [c.optimizer for c in chain.select(optimizer)] if optimizer else []
    # read and preflight: every rank its own shard (and a copy of what it holds now, to undo);
    # all ranks must agree on the iteration
    read = attempt(_read_legacy_shard, model, path, consensus.rank, children, scheduler)
    iteration = consensus.agree_same("legacy-preflight", read.map(lambda r: r[1]))
    saved, _, undo = read.value

    # apply, undone on every rank if it fails on any
    try:
        consensus.agree("legacy-apply", attempt(_apply_legacy, model, children, scheduler, saved, iteration))
    except CheckpointError:
        undo.restore()
        raise
    message = (
        f"{path} is a stock Miles adapter directory: restored the adapter weights only; NOT restored: "
        "fp32 master weights (refreshed from the adapter), optimizer moments, scheduler state"
        + (f" (repositioned to iteration {iteration})" if scheduler is not None and iteration else "")
    )
    return LoadResult(
        True,
        iteration,
        LoadSource.LEGACY_MILES,
        str(path),
        adapter_restored=True,
        masters_refreshed=bool(children),
        warnings=[message],
    )


def _read_legacy_shard(model, path: Path, rank: int, children: list, scheduler):
    coords = current_coordinates()
    candidates = [path / f"adapter_megatron_rank{rank}.pt", path / f"adapter_megatron_tp{coords.tp}_pp{coords.pp}.pt"]
    file = next((c for c in candidates if c.exists()), None)
    if file is None:
        raise FileNotFoundError(
            f"no legacy adapter shard for rank {rank} in {path} (tried {[c.name for c in candidates]})"
        )
    if chunk_count(model) != 1:
        raise ValueError("legacy Miles adapters have no chunk index: cannot warm-start a virtual-pipeline model")
    raw = _torch_load_weights_only(file)
    saved = {
        f"chunk0.{shards.strip_wrappers(name)}": tensor
        for name, tensor in raw.items()
        if shards.is_adapter_param_name(name)
    }
    params = shards.adapter_params(model)
    shards.preflight_adapter(params, saved, str(file))
    undo = UndoRecord.capture(params.values(), children, scheduler)
    return saved, _legacy_iteration(path, rank), undo


def _legacy_iteration(path: Path, rank: int) -> int | None:
    state_file = path / f"training_state_rank{rank}.pt"
    if not state_file.exists():
        return None
    try:
        return int(_torch_load_weights_only(state_file)["iteration"])
    except Exception:  # noqa: BLE001 - the iteration is informative; weights_only refusals are expected
        return None


def _torch_load_weights_only(file: Path):
    """`torch.load(weights_only=True)` of a regular file read with bounds; never a pickle fallback.

    A FIFO or link is refused without being opened, so nothing blocks.
    """
    try:
        data = file_reader.read_file_verified(file)
    except ValueError as exc:  # a FIFO, device or link: refused without opening it, named
        raise ValueError(f"{file}: {exc}; refusing to read it") from None
    return torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)


def _apply_legacy(model, children: list, scheduler, saved: dict, iteration: int | None) -> None:
    shards.copy_into(shards.adapter_params(model), saved)
    for child in children:
        child.reload_model_params()  # masters from the loaded adapter, or step 1 would undo it
    if scheduler is not None and iteration:
        reposition_scheduler(scheduler, iteration, 1)
