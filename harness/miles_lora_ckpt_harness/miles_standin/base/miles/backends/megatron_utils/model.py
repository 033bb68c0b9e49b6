"""Stand-in of miles/backends/megatron_utils/model.py: setup, initialize (load + scheduler step), save.

Every shape's: it binds the LoRA helpers from the shape's LoRA module, `lora/utils.py` (2026-09 on)
or `lora_utils.py` (2026-08), as Miles' model.py of that version does.
"""

from __future__ import annotations

from miles.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint, save_checkpoint_with_lora

try:
    from miles.backends.megatron_utils.lora.utils import is_lora_enabled, is_lora_model  # noqa: F401 - as Miles
except ModuleNotFoundError as error:  # 2026-08: lora_utils.py
    if error.name != "miles.backends.megatron_utils.lora":
        raise
    from miles.backends.megatron_utils.lora_utils import is_lora_enabled, is_lora_model  # noqa: F401 - as Miles

from miles_lora_ckpt_harness.miles_standin.common import training


def setup_model_and_optimizer(args, role: str = "actor"):
    return training.setup_model_and_optimizer(args, role)


def initialize_model_and_optimizer(args, role: str = "actor", checkpointing_context=None):
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(args, role)
    if args.load is None or training.has_loadable_ckpt(args.load):
        iteration, _ = load_checkpoint(
            model,
            optimizer,
            opt_param_scheduler,
            checkpointing_context=checkpointing_context,
            skip_load_to_model_and_opt=False,
        )
    else:
        iteration = 0
    # Miles steps it on top of what the load restored, unless the flag says so (double count)
    if opt_param_scheduler is not None and not (args.use_checkpoint_opt_param_scheduler and iteration > 0):
        opt_param_scheduler.step(increment=iteration * args.global_batch_size)
    return model, optimizer, opt_param_scheduler, iteration


def harness_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> float:
    """The harness's optimizer step (not Miles' train_one_step, which takes a data iterator)."""
    return training.train_one_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


def save(iteration, model, optimizer, opt_param_scheduler, checkpointing_context=None, non_persistent_ckpt=False):
    if is_lora_model(model):
        save_checkpoint_with_lora(iteration, model, optimizer, opt_param_scheduler)  # drops the context, as Miles does
    else:
        save_checkpoint(
            iteration,
            model,
            optimizer,
            opt_param_scheduler,
            checkpointing_context=checkpointing_context,
            non_persistent_ckpt=non_persistent_ckpt,
        )
