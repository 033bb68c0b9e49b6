"""Stand-ins for the few `megatron.training` functions Miles imports (Megatron-LM is not installed).

Megatron-LM's full-model checkpoints are not simulated: `save_checkpoint` and `load_checkpoint`
raise, so a stand-in run that reaches them (a non-LoRA model, or a `--load` that Miles takes for a
Megatron checkpoint) fails loudly instead of pretending.
"""

from __future__ import annotations

import os

_args = None


def set_args(args) -> None:
    global _args
    _args = args


def get_args():
    if _args is None:
        raise RuntimeError("megatron global args are not set (initialize.init has not run)")
    return _args


def save_checkpoint(*args, **kwargs):
    raise NotImplementedError("the Miles stand-in has no Megatron-LM (full-model) checkpoints")


def load_checkpoint(*args, **kwargs):
    raise NotImplementedError(
        "the Miles stand-in has no Megatron-LM checkpoint loader: Miles took --load for a Megatron checkpoint"
    )


def get_checkpoint_name(checkpoints_path: str, iteration: int, *, return_base_dir: bool = True) -> str:
    return os.path.join(checkpoints_path, f"iter_{iteration:07d}")
