"""Stand-in of miles/backends/megatron_utils/initialize.py: parallel state, then the custom init hook (§0)."""

from __future__ import annotations

from miles.utils.function_registry import load_function
from miles_lora_ckpt.sim.miles_standin.common import megatron_lm, training


def init(args) -> None:
    megatron_lm.set_args(args)
    training.initialize_model_parallel(args)
    if args.custom_megatron_init_path is not None:
        custom_init = load_function(args.custom_megatron_init_path)
        custom_init(args)
