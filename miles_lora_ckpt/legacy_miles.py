"""Warm start from a stock Miles adapter directory (`adapter_megatron_rank*.pt`): weights only.

Those files are pickles; they are read with `torch.load(weights_only=True)` and never with a
fallback. Masters are refreshed from the loaded adapter; moments and scheduler are not restored,
and the warning says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from miles_lora_ckpt.consensus import Consensus, attempt
from miles_lora_ckpt.lora_common import LoadResult, chunk_count
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import optimizer_state as ostate
from miles_lora_ckpt.megatron.scheduler import reposition_scheduler
from miles_lora_ckpt.megatron.topology import current_coordinates

log = logging.getLogger(__name__)


def warm_start_legacy(consensus: Consensus, model, path: Path, optimizer, scheduler) -> LoadResult:
    """Stock Miles `adapter_megatron_rank*.pt`: adapter weights only, read with weights_only=True."""
    read = attempt(_read_legacy_shard, model, path, consensus.rank)
    iterations = consensus.agree("legacy-preflight", read.map(lambda r: r[1]))
    consensus.agree("legacy-apply", attempt(_apply_legacy, model, optimizer, read.value[0] if read.ok else None))
    iteration = iterations[0] if len(set(iterations)) == 1 else None
    message = (
        f"{path} is a stock Miles adapter directory: restored the adapter weights only; NOT restored: "
        "fp32 master weights (refreshed from the adapter), optimizer moments, scheduler state"
    )
    log.warning(message)
    result = LoadResult(True, iteration, "legacy-miles", str(path), adapter_restored=True, warnings=[message])
    result.masters_refreshed = optimizer is not None
    if scheduler is not None and iteration:
        reposition_scheduler(scheduler, iteration, 1)
    return result


def _read_legacy_shard(model, path: Path, rank: int):
    coords = current_coordinates()
    candidates = [path / f"adapter_megatron_rank{rank}.pt", path / f"adapter_megatron_tp{coords.tp}_pp{coords.pp}.pt"]
    file = next((c for c in candidates if c.exists()), None)
    if file is None:
        raise FileNotFoundError(
            f"no legacy adapter shard for rank {rank} in {path} (tried {[c.name for c in candidates]})"
        )
    if chunk_count(model) != 1:
        raise ValueError("legacy Miles adapters have no chunk index: cannot warm-start a virtual-pipeline model")
    raw = torch.load(file, map_location="cpu", weights_only=True)
    saved = {
        f"chunk0.{shards.strip_wrappers(name)}": tensor
        for name, tensor in raw.items()
        if shards.is_adapter_param_name(name)
    }
    params = shards.adapter_params(model)
    shards.preflight_adapter(params, saved, str(file))
    return saved, _legacy_iteration(path, rank)


def _legacy_iteration(path: Path, rank: int) -> int | None:
    state_file = path / f"training_state_rank{rank}.pt"
    if not state_file.exists():
        return None
    try:
        return int(torch.load(state_file, map_location="cpu", weights_only=True)["iteration"])
    except Exception:  # noqa: BLE001 - the iteration is informative; weights_only refusals are expected
        return None


def _apply_legacy(model, optimizer, saved: dict) -> None:
    shards.copy_into(shards.adapter_params(model), saved)
    if optimizer is not None:
        for child in ostate.optimizer_children(optimizer):
            if not ostate.is_stub(child):
                child.reload_model_params()
