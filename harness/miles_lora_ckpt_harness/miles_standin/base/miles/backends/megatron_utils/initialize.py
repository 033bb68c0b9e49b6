"""Stand-in of miles/backends/megatron_utils/initialize.py: parallel state, then the custom init hook.

Every shape's: `load_function` comes from `miles.utils.function_registry` (2026-09 on) or
`miles.utils.misc` (2026-08), as Miles' initialize.py of that version imports it.
"""

from __future__ import annotations

try:
    from miles.utils.function_registry import load_function
except ModuleNotFoundError as error:  # 2026-08: miles.utils.misc
    if error.name != "miles.utils.function_registry":
        raise
    from miles.utils.misc import load_function

from miles_lora_ckpt_harness.miles_standin.common import indep_dp, megatron_lm, training


def init(args, indep_dp_store_addr=None, indep_dp_info=None) -> None:
    """`indep_dp_store_addr`, `indep_dp_info`: Miles' independent data-parallel cells (`common/indep_dp.py`);
    the stand-in runs one cell and refuses any other value."""
    indep_dp.require_one_cell(indep_dp_store_addr, indep_dp_info)
    megatron_lm.set_args(args)
    training.initialize_model_parallel(args)
    if args.custom_megatron_init_path is not None:
        custom_init = load_function(args.custom_megatron_init_path)
        custom_init(args)
