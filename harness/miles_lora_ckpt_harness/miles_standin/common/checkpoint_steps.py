"""What every shape's `checkpoint.py` does alike: the base load before the LoRA adapter, and where an adapter is saved.

Each shape's `load_checkpoint` and `save_checkpoint_with_lora` stay in its own module (the plugin
rebinds the LoRA functions they call by name there) and differ only in how they call
`load_lora_adapter`; the steps around that call are here.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from miles_lora_ckpt_harness.miles_standin.common import megatron_lm, training

log = logging.getLogger("miles.stand-in")


def is_megatron_checkpoint(path: str) -> bool:
    """Miles' `_is_megatron_checkpoint`: a Megatron checkpoint root, or one `iter_NNNNNNN` directory."""
    return os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")) or bool(
        re.fullmatch(r"iter_\d{7}", os.path.basename(os.path.normpath(path)))
    )


def load_base(args, ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt):
    """`(iteration, num_floating_point_operations)` of a Megatron checkpoint (or the in-memory
    manager's), else of the HF base model at `--load`; refuses a `--load` that is missing or empty."""
    load_path = args.load
    local = checkpointing_context is not None and "local_checkpoint_manager" in checkpointing_context
    if not local:
        assert load_path is not None and os.path.isdir(load_path) and os.listdir(load_path), (
            f"--load {load_path} does not exist or is empty"
        )
    if local or is_megatron_checkpoint(load_path):
        return megatron_lm.load_checkpoint(
            ddp_model=ddp_model,
            optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler,
            checkpointing_context=checkpointing_context,
            skip_load_to_model_and_opt=skip_load_to_model_and_opt,
        )
    return training.load_hf_base(ddp_model, optimizer, args, load_path)


def with_adapter_iteration(result: tuple, loaded: bool, iteration: int | None, adapter_path: str) -> tuple:
    """The load's result with the adapter's iteration, when the adapter load gave one."""
    if loaded and iteration is not None:
        return (iteration, result[1])
    log.warning("LoRA adapter from %s gave no iteration; keeping fresh adapters", adapter_path)
    return result


def adapter_dir(args, iteration: int) -> str:
    """`<save>/iter_NNNNNNN/adapter`, where `save_checkpoint_with_lora` puts a LoRA model's checkpoint."""
    return str(Path(args.save) / f"iter_{iteration:07d}" / "adapter")
