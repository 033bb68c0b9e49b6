"""Stand-in of miles/backends/megatron_utils/checkpoint.py: binds the LoRA functions by name."""

from __future__ import annotations

from miles.backends.megatron_utils.lora_utils import (
    is_lora_enabled,
    is_lora_model,
    load_lora_adapter,
    save_lora_checkpoint,
)

from miles_lora_ckpt_harness.miles_standin.common import checkpoint_steps
from miles_lora_ckpt_harness.miles_standin.common.checkpoint_steps import (  # noqa: F401 - Miles' name
    is_megatron_checkpoint as _is_megatron_checkpoint,
)
from miles_lora_ckpt_harness.miles_standin.common.megatron_lm import get_args, save_checkpoint
from miles_lora_ckpt_harness.miles_standin.common.megatron_lm import (  # noqa: F401 - Miles' name
    load_checkpoint as _load_checkpoint_megatron,
)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt):
    args = get_args()
    result = checkpoint_steps.load_base(
        args, ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt
    )
    if is_lora_enabled(args) and args.lora_adapter_path is not None:
        loaded, iteration = load_lora_adapter(
            ddp_model, args.lora_adapter_path, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler
        )
        result = checkpoint_steps.with_adapter_iteration(result, loaded, iteration, args.lora_adapter_path)
    return result


def save_checkpoint_with_lora(iteration, model, optimizer, opt_param_scheduler):
    args = get_args()
    if is_lora_model(model):
        save_lora_checkpoint(
            model,
            args,
            checkpoint_steps.adapter_dir(args, iteration),
            optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler,
            iteration=iteration,
        )
    else:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler)
