"""Rebind Miles' functions to the plugin's: plan everything first, then patch all of it, idempotently.

`plan(shape)` finds every module that holds each target: the defining module, the shape's
consumers, and any loaded `miles.*` module that bound the same function under the same name. A
module that holds something else under that name (another plugin's wrapper) fails the plan, and
nothing is patched. `apply(plan)` sets every attribute and logs it; if one fails, all are put back.
A second registration finds the replacements in place and patches nothing.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.integration import multi_lora, single_lora
from miles_lora_ckpt.integration.shapes import Shape, Target

__all__ = [
    "BindingRefused",
    "Binding",
    "Plan",
    "HANDLERS",
    "register_handlers",
    "plan",
    "apply",
    "is_replacement",
    "original_of",
]

log = logging.getLogger("miles_lora_ckpt.integration")

HANDLERS: dict[str, Callable] = {}
_ORIGINAL = "__miles_lora_ckpt_original__"
_HANDLER = "__miles_lora_ckpt_handler__"


def register_handlers(handlers: Mapping[str, Callable]) -> None:
    """Make replacement factories `(original, target) -> replacement` available by key."""
    HANDLERS.update(handlers)


register_handlers(single_lora.HANDLERS)
register_handlers(multi_lora.HANDLERS)


class BindingRefused(MilesLoraCkptError, ValueError):
    """A module holds something unexpected under a name the plugin must rebind; nothing was patched."""


@dataclass(frozen=True)
class Binding:
    """One attribute to set: `module.<target.name>` from `original` to `replacement`."""

    target: Target
    module_name: str
    module: ModuleType
    original: Callable
    replacement: Callable
    done: bool  # the attribute already holds the replacement

    @property
    def where(self) -> str:
        return f"{self.module_name}.{self.target.name}"


@dataclass
class Plan:
    """What `apply` will set for one shape: every binding, and notes for the log."""

    shape: Shape
    bindings: list[Binding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def pending(self) -> list[Binding]:
        return [b for b in self.bindings if not b.done]


def is_replacement(obj: object) -> bool:
    """Whether `obj` is one of the plugin's replacements (it carries its original)."""
    return callable(obj) and getattr(obj, _HANDLER, None) is not None


def original_of(obj: Callable) -> Callable:
    """Miles' own function behind a replacement (the object itself otherwise)."""
    return getattr(obj, _ORIGINAL, obj)


def plan(
    shape: Shape,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    modules: Mapping[str, ModuleType] | None = None,
) -> Plan:
    """Everything `apply` would do for `shape`; changes nothing. Raises BindingRefused."""
    loaded = sys.modules if modules is None else modules
    result = Plan(shape)
    for target in shape.targets:
        try:
            defining = import_module(target.module)
        except Exception:  # noqa: BLE001 - only optional targets get here (detection checked the rest)
            result.notes.append(f"{target.qualified}: module not importable, optional: not bound")
            continue
        current = getattr(defining, target.name, None)
        if current is None:
            result.notes.append(f"{target.qualified}: absent, optional: not bound")
            continue
        original = original_of(current)
        replacement = current if is_replacement(current) else _make(target, original)
        for name, module in _sites(target, import_module, loaded, original):
            value = vars(module).get(target.name)
            if value is replacement:
                result.bindings.append(Binding(target, name, module, original, replacement, True))
            elif value is original:
                result.bindings.append(Binding(target, name, module, original, replacement, False))
            elif value is not None and name != target.module and name not in target.consumers:
                continue  # a late consumer or scanned module with an unrelated object of that name
            elif value is None:
                raise BindingRefused(
                    f"{name} does not bind {target.name} by name, as Miles shape {shape.name!r} does: "
                    "unknown Miles shape, nothing was patched"
                )
            else:
                raise BindingRefused(
                    f"{name}.{target.name} is {value!r}, neither Miles' {target.qualified} nor miles-lora-ckpt's "
                    "replacement (another plugin wrapped it?): nothing was patched"
                )
    return result


def apply(binding_plan: Plan) -> list[str]:
    """Set every pending attribute; on any failure put every one back. Returns `module.name` of all sites."""
    done: list[Binding] = []
    try:
        for binding in binding_plan.pending:
            setattr(binding.module, binding.target.name, binding.replacement)
            done.append(binding)
            log.info(
                "miles-lora-ckpt: %s -> %s (shape %s)",
                binding.where,
                f"{HANDLERS[binding.target.handler].__module__}.{binding.target.handler}",
                binding_plan.shape.name,
            )
    except BaseException:
        for binding in reversed(done):
            setattr(binding.module, binding.target.name, binding.original)
        raise
    for binding in binding_plan.bindings:
        if binding.done:
            log.info("miles-lora-ckpt: %s already bound", binding.where)
    for note in binding_plan.notes:
        log.info("miles-lora-ckpt: %s", note)
    return [b.where for b in binding_plan.bindings]


def _make(target: Target, original: Callable) -> Callable:
    factory = HANDLERS.get(target.handler)
    if factory is None:
        raise BindingRefused(f"no handler registered for {target.handler!r} ({target.qualified})")
    replacement = factory(original, target)
    setattr(replacement, _ORIGINAL, original)
    setattr(replacement, _HANDLER, target.handler)
    return replacement


def _sites(target: Target, import_module, loaded: Mapping[str, ModuleType], original: Callable):
    """(name, module) of every module that holds (or must hold) `target.name`, defining module first."""
    sites: dict[str, ModuleType] = {target.module: import_module(target.module)}
    for name in target.consumers:
        sites[name] = import_module(name)  # detection imported them already
    for name in target.late_consumers:
        if name in loaded:
            sites[name] = loaded[name]
    for name, module in list(loaded.items()):
        if name in sites or not (name == "miles" or name.startswith("miles.")) or module is None:
            continue
        value = vars(module).get(target.name) if hasattr(module, "__dict__") else None
        if value is not None and original_of(value) is original:
            sites[name] = module
    return list(sites.items())
