"""Stand-in of miles/backends/megatron_utils/lora/utils.py (§10.1): load_lora_adapter(..., load_optimizer=True).

Saves go through checkpoint_io (the adapter directory becomes a symlink to a version directory);
`--no-save-optim` drops only the optimizer entry (PR #3083). Masters and moments are still not
saved, the training state is still a pickle, and nothing refreshes the masters after a load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles.backends.training_utils.checkpoint_io import write_checkpoint_dir
from miles.utils.lora.utils import is_lora_enabled, lora_rollout_enabled  # noqa: F401 - re-exported
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
    with_optimizer = not getattr(args, "no_save_optim", False)
    Path(save_dir).parent.mkdir(parents=True, exist_ok=True)

    def write_shards(staging: Path) -> None:
        stock.write_rank_files(staging, model, optimizer, opt_param_scheduler, iteration, with_optimizer=with_optimizer)

    write_checkpoint_dir(save_dir, write_shards)
    return str(save_dir)


def load_lora_adapter(
    model: Sequence[torch.nn.Module],
    adapter_path: str,
    *,
    optimizer: Any | None = None,
    opt_param_scheduler: Any | None = None,
    load_optimizer: bool = True,
) -> tuple[bool, int | None]:
    adapter_dir = Path(adapter_path)
    if not adapter_dir.exists():
        log.warning("LoRA adapter path %s does not exist", adapter_path)
        return False, None
    adapter_dir = adapter_dir.resolve()  # follows the version symlink
    state = stock.read_adapter_shard(adapter_dir)
    if state is not None:
        stock.copy_adapter(model, state)  # no reload_model_params()
        iteration = _load_training_state(adapter_dir, optimizer, opt_param_scheduler, load_optimizer)
        return True, iteration
    log.warning("no LoRA adapter shard in %s", adapter_dir)
    return False, None


def _load_training_state(
    adapter_dir: Path, optimizer: Any | None, opt_param_scheduler: Any | None, load_optimizer: bool = True
) -> int | None:
    if optimizer is None:
        return None
    state = stock.read_training_state(Path(adapter_dir))
    if state is None:
        return None
    return stock.apply_training_state(state, optimizer, opt_param_scheduler, load_optimizer=load_optimizer)
