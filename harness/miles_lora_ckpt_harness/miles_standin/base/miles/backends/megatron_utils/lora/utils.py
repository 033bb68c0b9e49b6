"""Stand-in of miles/backends/megatron_utils/lora/utils.py: load_lora_adapter(..., load_optimizer=True).

Saves go through checkpoint_io (the adapter directory becomes a symlink to a version directory);
`--no-save-optim` drops only the optimizer entry (PR #3083). Masters and moments are still not
saved, the training state is still a pickle, and nothing refreshes the masters after a load.
`load_lora_adapter` calls `_load_training_state` through this module's global, as Miles does.
The shared steps are `common/stock.py`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from miles.backends.training_utils.checkpoint_io import write_checkpoint_dir  # noqa: F401 - bound here, as Miles does
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
    return stock.save_published(model, args, save_dir, optimizer, opt_param_scheduler, iteration)


def load_lora_adapter(
    model: Sequence[torch.nn.Module],
    adapter_path: str,
    *,
    optimizer: Any | None = None,
    opt_param_scheduler: Any | None = None,
    load_optimizer: bool = True,
) -> tuple[bool, int | None]:
    adapter_dir = stock.load_adapter(model, adapter_path, follow_symlink=True, peft_hint=False)
    if adapter_dir is None:
        return False, None
    return True, _load_training_state(adapter_dir, optimizer, opt_param_scheduler, load_optimizer)


def _load_training_state(
    adapter_dir: Path, optimizer: Any | None, opt_param_scheduler: Any | None, load_optimizer: bool = True
) -> int | None:
    return stock.load_training_state(adapter_dir, optimizer, opt_param_scheduler, load_optimizer)
