"""Thin adapter to Megatron-Bridge's adapter export; imports `megatron.bridge` lazily.

Bridge converts Megatron-side LoRA weights to HF names; the plugin owns every barrier around it
(`savers/peft_export`). What this module relies on in Bridge is listed in docs/peft-export.md,
"Bridge's export: keywords and item shapes". In short:

- `AutoBridge.export_adapter_weights(model, ...)` is a lazy, collective generator. Every rank must
  iterate it fully and in the same order.
- Its items differ by build, and `normalize_item` accepts them all. NVIDIA builds (0.6.2, `main`)
  yield `HFWeightTuple(param_name, weight)`. The fork Miles installs yields plain tuples
  `(hf_name, weight, megatron_name)`. An indexed fork version yields `HFSourcedWeightTuple`, whose
  third field is a tuple of Megatron names.
- Keywords are bound against the installed signature (`bind_options`). `cpu=True` and
  `show_progress=False` are passed where the signature has them. `exclude_adapter_base_prefixes`
  (0.6.2, `main`) and `expand_shared_outer` (`main` only) are passed only when asked for. A
  Bridge whose signature lacks an asked-for keyword is refused with a TypeError, never ignored.
- Recent builds have four pure helpers in `peft_bridge`. `peft_helpers()` returns those whose
  signatures it recognises, and the exporter uses its own for the rest.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BRIDGE_MODULE = "megatron.bridge"
HELPERS_MODULE = "megatron.bridge.models.conversion.peft_bridge"
MULTI_LORA_MODULE = "megatron.bridge.peft.multi_lora_layers"  # Bridge's multi-LoRA slot helpers
OPTIONAL_EXPORT_KWARGS = {"cpu": True, "show_progress": False}  # passed only where the signature has them

__all__ = [
    "BridgeSource",
    "ExportedWeight",
    "PeftHelpers",
    "bind_options",
    "bridge_version",
    "expose_adapter_slot",
    "import_error",
    "normalize_item",
    "peft_helpers",
    "slot_export_error",
    "slot_export_problem",
    "slot_problem_message",
]


@dataclass(frozen=True)
class ExportedWeight:
    """One adapter tensor as Bridge yields it; field names match Bridge's `HFWeightTuple`."""

    param_name: str  # HF name, e.g. model.layers.0.self_attn.q_proj.lora_A.weight
    weight: Any  # torch.Tensor
    megatron_name: str | None = None  # the Megatron name when exactly one is known (the fork's third item)
    megatron_param_names: tuple[str, ...] = ()  # every Megatron name Bridge gave (empty: none given)


def normalize_item(item: Any) -> ExportedWeight:
    """One item of Bridge's export as an `ExportedWeight`.

    `item` is a named tuple with `param_name` and `weight`, optionally with `megatron_name` or
    `megatron_param_names`. Or it is a plain 2- or 3-item tuple whose third item is a Megatron name
    or a list of them. Raises TypeError on any other shape or type.
    """
    import torch

    if hasattr(item, "param_name") and hasattr(item, "weight"):
        name, weight = item.param_name, item.weight
        third = getattr(item, "megatron_param_names", getattr(item, "megatron_name", None))
    elif isinstance(item, tuple | list) and len(item) in (2, 3):
        name, weight = item[0], item[1]
        third = item[2] if len(item) == 3 else None
    else:
        size = len(item) if isinstance(item, tuple | list) else "no"
        raise TypeError(
            f"Bridge's export yielded {type(item).__name__} with {size} items; expected (name, weight), "
            "(name, weight, megatron_name) or (name, weight, megatron_param_names)"
        )
    if not isinstance(name, str) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"Bridge's export yielded ({type(name).__name__}, {type(weight).__name__}), not (str, Tensor)")
    megatron_names = _megatron_names(name, third)
    return ExportedWeight(name, weight, megatron_names[0] if len(megatron_names) == 1 else None, megatron_names)


def _megatron_names(name: str, third: Any) -> tuple[str, ...]:
    if third is None:
        return ()
    if isinstance(third, str):
        return (third,)
    if isinstance(third, tuple | list) and all(isinstance(n, str) for n in third):
        return tuple(third)
    raise TypeError(
        f"Bridge's export yielded {name!r} with a third item of type {type(third).__name__}; expected a "
        "Megatron parameter name or a tuple of them"
    )


def bind_options(fn: Callable, *, required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `fn`: every `required` one, and the `optional` ones its signature has.

    Raises TypeError naming a `required` keyword the installed signature lacks.
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in required if name not in params and not takes_any]
    if missing:
        raise TypeError(
            f"the installed Megatron-Bridge {getattr(fn, '__qualname__', fn)}{inspect.signature(fn)} has no "
            f"parameter {', '.join(missing)}"
        )
    return dict(required) | {k: v for k, v in optional.items() if k in params}


def import_error() -> str | None:
    """None when `megatron.bridge` imports here, else why not (for skips and error messages)."""
    try:
        importlib.import_module(BRIDGE_MODULE)
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return f"{type(exc).__name__}: {exc}"
    return None


def expose_adapter_slot() -> Callable:
    """Bridge's `expose_adapter_slot(model, idx)` function.

    It is a context manager under which every multi-LoRA linear shows slot `idx` as its single-LoRA
    `.adapter`, which `export_adapter_weights` walks. Raises ImportError or AttributeError when
    the installed Bridge has none.
    """
    function = importlib.import_module(MULTI_LORA_MODULE).expose_adapter_slot
    if not callable(function):
        raise AttributeError(f"{MULTI_LORA_MODULE}.expose_adapter_slot is not callable")
    return function


def bridge_version() -> str:
    """The installed Megatron-Bridge's version, or "not installed".

    It is read from the package metadata; Bridge is not imported.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-bridge")
    except PackageNotFoundError:
        return "not installed"


def slot_export_problem() -> str | None:
    """None when per-slot exports can select a slot here, else the reason as one sentence.

    A slot can be selected where Bridge's `expose_adapter_slot` imports. The sentence names the
    installed Bridge version, why it cannot, and the remedy.
    """
    why = slot_export_error()
    return None if why is None else slot_problem_message(why)


def slot_problem_message(why: str) -> str:
    """The refusal's sentence for a Bridge whose `expose_adapter_slot` does not import (`why`)."""
    return (
        f"a per-slot export selects the slot with Megatron-Bridge's {MULTI_LORA_MODULE}.expose_adapter_slot, "
        f"which this Bridge lacks (megatron-bridge {bridge_version()}: {why}); install a Megatron-Bridge that "
        f"has {MULTI_LORA_MODULE} (NVIDIA's main branch, or the Miles fork; release 0.6.2 has none)"
    )


def slot_export_error() -> str | None:
    """None when Bridge's `expose_adapter_slot` imports here, else why not."""
    try:
        expose_adapter_slot()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class PeftHelpers:
    """Bridge's `peft_bridge` conversion helpers that the installed build has (None: use ours)."""

    convert: Callable | None = None  # (weights) -> (state, module names, target_parameters)
    target_modules: Callable | None = None  # (names) -> [short module names]
    rank_pattern: Callable | None = None  # (weights, *, default_rank) -> {module: rank}
    build_config: Callable | None = None  # (peft_config, target_modules, ...) -> dict
    build_config_options: tuple[str, ...] = ()  # which optional keywords build_config takes


_HELPER_SIGNATURES = {
    "convert": ("convert_adapter_weights_to_peft_state", ("adapter_weights",)),
    "target_modules": ("infer_target_modules_from_adapter_weights", ("adapter_weight_names",)),
    "rank_pattern": ("infer_rank_pattern_from_adapter_weights", ("adapter_weights", "default_rank")),
    "build_config": ("build_adapter_config_dict", ("peft_config", "target_modules")),
}


def peft_helpers() -> PeftHelpers:
    """The installed Bridge's PEFT helpers whose signatures match the documented ones.

    Returns an empty `PeftHelpers` when Bridge does not import; raises nothing.
    """
    try:
        module = importlib.import_module(HELPERS_MODULE)
    except Exception:  # noqa: BLE001 - no Bridge, or an old one: our own helpers are used
        return PeftHelpers()
    found: dict[str, Any] = {}
    for field, (name, wanted) in _HELPER_SIGNATURES.items():
        fn = getattr(module, name, None)
        if callable(fn) and all(p in inspect.signature(fn).parameters for p in wanted):
            found[field] = fn
    if "build_config" in found:
        params = inspect.signature(found["build_config"]).parameters
        options = ("target_parameters", "base_model_name_or_path", "rank_pattern")
        found["build_config_options"] = tuple(o for o in options if o in params)
    return PeftHelpers(**found)


class BridgeSource:
    """Adapter weights from Megatron-Bridge's collective `export_adapter_weights`.

    Give it a `bridge`, or an `hf_checkpoint` to build one from; ValueError otherwise.

    - `prepare()` is rank-local and may fail, so callers agree on it before any rank enters the
      collective `export()`. It builds `AutoBridge.from_hf_pretrained(hf_checkpoint)` unless a
      bridge was given, and binds the export's options by signature.
    - `model_context(model)` wraps the export. Miles passes its `patch_megatron_model`; multi-LoRA
      also selects the slot there.
    - `transform(weight)` maps each exported weight; multi-LoRA slices it to the slot's rank. Its
      errors, like any per-item error, are raised only after the iteration completed.
    - `export_options` are required keywords (e.g. `exclude_adapter_base_prefixes`). An installed
      Bridge without one is refused, not ignored.
    """

    kind = "megatron-bridge"

    def __init__(
        self,
        bridge: Any = None,
        *,
        hf_checkpoint: str | None = None,
        trust_remote_code: bool = True,
        model_context: Callable[[Any], Any] | None = None,
        transform: Callable[[ExportedWeight], ExportedWeight] | None = None,
        export_options: dict[str, Any] | None = None,
        exclude_adapter_base_prefixes: list[str] | tuple[str, ...] | None = None,
        expand_shared_outer: bool | None = None,
    ):
        if bridge is None and hf_checkpoint is None:
            raise ValueError("BridgeSource needs a bridge or an hf_checkpoint to build one from")
        self.bridge = bridge
        self.hf_checkpoint = hf_checkpoint
        self.trust_remote_code = trust_remote_code
        self.model_context = model_context
        self.transform = transform
        self.export_options = dict(export_options or {})
        if exclude_adapter_base_prefixes is not None:
            self.export_options["exclude_adapter_base_prefixes"] = list(exclude_adapter_base_prefixes)
        if expand_shared_outer is not None:
            self.export_options["expand_shared_outer"] = bool(expand_shared_outer)
        self._kwargs: dict[str, Any] | None = None

    def prepare(self) -> None:
        """Rank-local set-up; no collectives.

        Raises ImportError when Bridge is missing, TypeError when its export does not fit.
        """
        if self.bridge is None:
            auto_bridge = importlib.import_module(BRIDGE_MODULE).AutoBridge
            self.bridge = auto_bridge.from_hf_pretrained(self.hf_checkpoint, trust_remote_code=self.trust_remote_code)
        export = getattr(self.bridge, "export_adapter_weights", None)
        if not callable(export):
            raise TypeError(f"{type(self.bridge).__name__} has no export_adapter_weights (Megatron-Bridge too old?)")
        self._kwargs = bind_options(export, required=self.export_options, optional=OPTIONAL_EXPORT_KWARGS)

    def export(self, model, on_item: Callable[[int, ExportedWeight], None] | None = None) -> list[ExportedWeight]:
        """Collective. Iterate Bridge's export fully on this rank; return every weight.

        `on_item(index, weight)` is called for each weight. An error in handling one item does not
        stop the iteration, so this rank keeps taking part in Bridge's gathers. The first such
        error is raised at the end. An error raised by Bridge itself ends its generator and is
        raised as is. Raises RuntimeError before `prepare()`.
        """
        if self._kwargs is None:
            raise RuntimeError("BridgeSource.export() before prepare()")
        weights: list[ExportedWeight] = []
        first_error: Exception | None = None
        context = self.model_context(model) if self.model_context else contextlib.nullcontext()
        with context:
            for index, item in enumerate(self.bridge.export_adapter_weights(model, **self._kwargs)):
                if first_error is not None:
                    continue  # keep draining: the peers are in the same collectives
                try:
                    weight = normalize_item(item)
                    if self.transform is not None:
                        weight = self.transform(weight)
                    if on_item is not None:
                        on_item(index, weight)
                    weights.append(weight)
                except Exception as exc:  # noqa: BLE001 - raised after the iteration completes
                    first_error = exc
        if first_error is not None:
            raise first_error
        return weights

    def conversion_helpers(self) -> PeftHelpers:
        """The installed Bridge's PEFT conversion helpers (`peft_helpers()`)."""
        return peft_helpers()
