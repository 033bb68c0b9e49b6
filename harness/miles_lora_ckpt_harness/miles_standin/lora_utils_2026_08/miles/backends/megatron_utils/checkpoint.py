"""Stand-in of miles/backends/megatron_utils/checkpoint.py (§2.1): binds the LoRA functions by name."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from miles.backends.megatron_utils.lora_utils import (
    is_lora_enabled,
    is_lora_model,
    load_lora_adapter,
    save_lora_checkpoint,
)
from miles_lora_ckpt_harness.miles_standin.common import training
from miles_lora_ckpt_harness.miles_standin.common.megatron_lm import get_args, save_checkpoint
from miles_lora_ckpt_harness.miles_standin.common.megatron_lm import load_checkpoint as _load_checkpoint_megatron

log = logging.getLogger("miles.stand-in")


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt):
    args = get_args()
    load_path = args.load
    local = checkpointing_context is not None and "local_checkpoint_manager" in checkpointing_context
    if not local:
        assert load_path is not None and os.path.isdir(load_path) and os.listdir(load_path), (
            f"--load {load_path} does not exist or is empty"
        )
    if local or _is_megatron_checkpoint(load_path):
        result = _load_checkpoint_megatron(
            ddp_model=ddp_model,
            optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler,
            checkpointing_context=checkpointing_context,
            skip_load_to_model_and_opt=skip_load_to_model_and_opt,
        )
    else:
        result = training.load_hf_base(ddp_model, optimizer, args, load_path)
    if is_lora_enabled(args) and args.lora_adapter_path is not None:
        loaded, iteration = load_lora_adapter(
            ddp_model, args.lora_adapter_path, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler
        )
        if loaded and iteration is not None:
            result = (iteration, result[1])
        else:
            log.warning("LoRA adapter from %s gave no iteration; keeping fresh adapters", args.lora_adapter_path)
    return result


def _is_megatron_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")) or bool(
        re.fullmatch(r"iter_\d{7}", os.path.basename(os.path.normpath(path)))
    )


def save_checkpoint_with_lora(iteration, model, optimizer, opt_param_scheduler):
    args = get_args()
    if is_lora_model(model):
        save_dir = Path(args.save) / f"iter_{iteration:07d}" / "adapter"
        save_lora_checkpoint(
            model,
            args,
            str(save_dir),
            optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler,
            iteration=iteration,
        )
    else:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler)
