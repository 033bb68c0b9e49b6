"""Stand-in of miles/backends/megatron_utils/lora_utils.py (radixark/miles 31f1ca961a94): the stock LoRA checkpoint.

`load_lora_adapter` calls `_load_training_state` through this module's global, as Miles does. Saves
write in place on every rank and ignore `--no-save-optim`; the shared steps are `common/stock.py`'s.
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
    return stock.save_in_place(model, save_dir, optimizer, opt_param_scheduler, iteration)


def load_lora_adapter(
    model: Sequence[torch.nn.Module],
    adapter_path: str,
    *,
    optimizer: Any | None = None,
    opt_param_scheduler: Any | None = None,
) -> tuple[bool, int | None]:
    adapter_dir = stock.load_adapter(model, adapter_path, follow_symlink=False, peft_hint=True)
    if adapter_dir is None:
        return False, None
    return True, _load_training_state(adapter_dir, optimizer, opt_param_scheduler)


def _load_training_state(adapter_dir: Path, optimizer: Any | None, opt_param_scheduler: Any | None) -> int | None:
    return stock.load_training_state(adapter_dir, optimizer, opt_param_scheduler)
