"""Stand-in of miles/backends/megatron_utils/lora_utils.py (snapshot, §1): the stock LoRA checkpoint.

`load_lora_adapter` calls `_load_training_state` through this module's global, as Miles does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles.utils.lora import is_lora_enabled, lora_rollout_enabled  # noqa: F401 - re-exported, as Miles does
from miles_lora_ckpt_harness.miles_standin.common import stock

log = logging.getLogger("miles.stand-in")


def is_lora_model(model: Sequence[torch.nn.Module]) -> bool:
    return stock.is_lora_model(model)


def _is_adapter_param_name(name: str) -> bool:
    return stock.is_adapter_param_name(name)


def save_lora_checkpoint(
    model: Sequence[torch.nn.Module],
    args,
    save_dir: str,
    *,
    optimizer: Any | None = None,
    opt_param_scheduler: Any | None = None,
    iteration: int | None = None,
) -> str:
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)  # every rank
    stock.barrier()
    # --no-save-optim is ignored here (fixed later by PR #3083)
    stock.write_rank_files(save_dir, model, optimizer, opt_param_scheduler, iteration, with_optimizer=True)
    stock.barrier()
    return str(save_dir)


def load_lora_adapter(
    model: Sequence[torch.nn.Module],
    adapter_path: str,
    *,
    optimizer: Any | None = None,
    opt_param_scheduler: Any | None = None,
) -> tuple[bool, int | None]:
    adapter_dir = Path(adapter_path)
    if not adapter_dir.exists():
        log.warning("LoRA adapter path %s does not exist", adapter_path)
        return False, None
    state = stock.read_adapter_shard(adapter_dir)
    if state is not None:
        stock.copy_adapter(model, state)  # no reload_model_params(): the masters stay stale
        iteration = _load_training_state(adapter_dir, optimizer, opt_param_scheduler)
        return True, iteration
    if (adapter_dir / "adapter_model.bin").exists():
        log.warning("HF PEFT adapter import is not implemented: %s", adapter_dir)
        return False, None
    log.warning("no LoRA adapter shard in %s", adapter_dir)
    return False, None


def _load_training_state(adapter_dir: Path, optimizer: Any | None, opt_param_scheduler: Any | None) -> int | None:
    if optimizer is None:
        return None
    state = stock.read_training_state(Path(adapter_dir))
    if state is None:
        return None
    return stock.apply_training_state(state, optimizer, opt_param_scheduler)
