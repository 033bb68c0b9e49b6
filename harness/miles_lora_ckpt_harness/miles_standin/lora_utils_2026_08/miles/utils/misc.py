"""Stand-in of miles/utils/misc.py: `load_function` (plugin hooks by dotted path) and the save cadence."""

import importlib
import inspect

from miles_lora_ckpt_harness.miles_standin.common.args import should_run_periodic_action

__all__ = ["load_function", "should_run_periodic_action"]


def load_function(path: str, *, sync_required: bool = False):
    """The object at a dotted path; `sync_required`: refuse a coroutine function, as Miles does for
    callers that run the function synchronously (Miles' function registry is not stood in here)."""
    module_name, _, attr = path.rpartition(".")
    function = getattr(importlib.import_module(module_name), attr)
    if sync_required and inspect.iscoroutinefunction(function):
        raise TypeError(f"{path} is a coroutine function; this caller runs it synchronously")
    return function
