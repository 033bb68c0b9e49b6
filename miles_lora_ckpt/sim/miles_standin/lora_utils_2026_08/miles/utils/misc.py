"""Stand-in of miles/utils/misc.py: `load_function` (plugin hooks by dotted path) and the save cadence."""

import importlib

from miles_lora_ckpt.sim.miles_standin.common.args import should_run_periodic_action

__all__ = ["load_function", "should_run_periodic_action"]


def load_function(path: str):
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)
