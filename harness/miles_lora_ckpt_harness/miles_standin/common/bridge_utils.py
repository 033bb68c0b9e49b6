"""Stand-in of `patch_megatron_model` from miles/utils/megatron_bridge_utils.py.

Miles calls Megatron-Bridge on its list of model chunks inside `patch_megatron_model(model)`, a
context manager. Bridge reads `share_embeddings_and_output_weights` from the model's config, where
Megatron keeps it on the model itself. While the context is open, the first chunk's config (below
DDP and Float16Module) has it, copied from the model. On exit, an attribute the context added is
taken away again. The stand-in does that, and counts the times it was entered in this process
(`entries()`), so that a test can tell the plugin ran Bridge inside Miles' context.
"""

from __future__ import annotations

from contextlib import contextmanager

ATTRIBUTE = "share_embeddings_and_output_weights"
_entries = 0


def entries() -> int:
    """How many times `patch_megatron_model` was entered in this process."""
    return _entries


def _innermost(chunk):
    while hasattr(chunk, "module"):  # DistributedDataParallel, then Float16Module
        chunk = chunk.module
    return chunk


@contextmanager
def patch_megatron_model(model):
    global _entries
    inner = _innermost(model[0])
    config = inner.config
    missing = not hasattr(config, ATTRIBUTE)
    if missing:
        setattr(config, ATTRIBUTE, bool(getattr(inner, ATTRIBUTE, False)))
    _entries += 1
    try:
        yield
    finally:
        if missing:
            delattr(config, ATTRIBUTE)
