"""What the init hook leaves in each training process, for the replaced functions to read.

`install.install` sets one `Runtime` per process once the bindings are in place. Replacements read
it at call time (`current()`), never at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_lora_ckpt.integration.config import PluginConfig
from miles_lora_ckpt.integration.shapes import Shape

__all__ = [
    "Runtime",
    "current",
    "set_current",
    "installed",
]


@dataclass
class Runtime:
    """The args object Miles passed to the hook (also Megatron's global args), config and shape."""

    args: Any
    config: PluginConfig
    shape: Shape
    saved: dict[int, str] = field(default_factory=dict)  # iteration -> committed generation directory
    user_post_save_hook: str | None = None  # the user's --custom-megatron-post-save-hook-path
    scheduler_pin: dict | None = None  # scheduler state a plugin load decided; re-applied after Miles' step
    fresh_start: bool = False  # the actor's load found nothing to resume (or --finetune): start at rollout 0
    validated_optimizers: set[int] = field(default_factory=set)  # id() of optimizers startup-checked
    initial_adapter: dict | None = None  # the actor's adapter before a resume (for ref/teacher loads)
    bindings: list[str] = field(default_factory=list)  # "module.name" of every rebound name
    # the PEFT export (savers.peft_export.PeftExport, Bridge built) when export.peft or --save-hf asks for
    # one; None otherwise (see integration.peft)
    peft: Any = None
    slot_peft: bool = False  # multi-LoRA: each slot save exports the slot through `peft`'s Bridge
    # with save.async: the process's savers.single_lora.async_save.AsyncSaver, made at the first save
    async_saver: Any = None
    multi_lora_optimizers: dict[int, Any] = field(default_factory=dict)  # id(model) -> its per-slot chain
    multi_lora_pending: dict[int, tuple] = field(
        default_factory=dict
    )  # id(model) -> (optimizer, args) in load_adapters
    # v1: id(model) -> {slot: saved scheduler state} kept by _register_adapter for load_adapters
    multi_lora_schedulers: dict[int, dict] = field(default_factory=dict)
    multi_lora_scheduler_restores: dict[int, int] = field(default_factory=dict)  # slot -> num_steps restored (last)


_current: Runtime | None = None


def current() -> Runtime:
    """The installed runtime; raises if the init hook has not run in this process."""
    if _current is None:
        raise RuntimeError(
            "miles-lora-ckpt is not installed in this process: pass "
            "--custom-megatron-init-path miles_lora_ckpt.hooks.megatron_init"
        )
    return _current


def installed() -> Runtime | None:
    """The installed runtime, or None when the init hook has not run in this process."""
    return _current


def set_current(runtime: Runtime | None) -> None:
    """Install `runtime` as this process's runtime; None removes it."""
    global _current
    _current = runtime
