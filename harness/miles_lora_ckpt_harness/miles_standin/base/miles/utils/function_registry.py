"""Stand-in of miles/utils/function_registry.py: `load_function` moved here; a registry first."""

import importlib
from contextlib import contextmanager

_registry: dict = {}


@contextmanager
def temporary(name: str, function):
    _registry[name] = function
    try:
        yield
    finally:
        _registry.pop(name, None)


def load_function(path: str, *, sync_required: bool = False):
    if path in _registry:
        return _registry[path]
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)
