"""Stand-in of miles/utils/misc.py: re-exports `load_function`; the save cadence."""

from miles.utils.function_registry import load_function

from miles_lora_ckpt_harness.miles_standin.common.args import should_run_periodic_action

__all__ = ["load_function", "should_run_periodic_action"]
