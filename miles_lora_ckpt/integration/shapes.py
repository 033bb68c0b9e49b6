"""The Miles shapes this plugin knows, and how a running Miles is matched against them.

Miles keeps moving: modules were renamed and signatures changed between versions. A *shape* lists,
for one version of Miles, every function the plugin takes over (`Target`). Each target names where
it is defined, its exact signature, and the modules that bind it by name at import.
`detect_shape` returns the first shape that matches in every target. When none does, it raises
`UnknownMilesShape`, naming each difference found, and nothing is patched.

A shape also names the context manager Miles runs Megatron-Bridge under (`bridge_model_context`),
which the PEFT export calls; it is resolved at startup only when the run exports.

Multi-LoRA targets are optional: v1's `multi_lora_utils` in `lora-utils-2026-08`, v2's
`lora/checkpoint.py` in `lora-package-2026-09`. Absent, multi-LoRA runs are refused at startup;
present, they are checked like every other target. A new Miles version is one more `Shape` in
`SHAPES`, newest first. docs/use-with-miles.md, "Miles versions (shapes)", lists them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from miles_lora_ckpt.core.errors import MilesLoraCkptError

__all__ = [
    "Target",
    "Shape",
    "SHAPES",
    "SHAPES_BY_NAME",
    "Difference",
    "UnknownMilesShape",
    "render_signature",
    "detect_shape",
    "shape_differences",
    "HF_EXPORT",
    "MULTI_LORA_UTILS",
    "LORA_CHECKPOINT",
    "LORA_ACTOR",
]

MEGATRON_UTILS = "miles.backends.megatron_utils"
LORA_UTILS_2026_08 = f"{MEGATRON_UTILS}.lora_utils"
LORA_UTILS_PACKAGE = f"{MEGATRON_UTILS}.lora.utils"
CHECKPOINT = f"{MEGATRON_UTILS}.checkpoint"
MODEL = f"{MEGATRON_UTILS}.model"
ACTOR = f"{MEGATRON_UTILS}.actor"
HF_EXPORT = f"{MEGATRON_UTILS}.hf_export"
FT_IN_MEMORY = f"{MEGATRON_UTILS}.ft.in_memory_checkpoint"
DEBUG_WORKER = "miles.utils.debug_utils.run_megatron.worker.main"  # Miles' debug tool, a late consumer
# Miles runs Bridge's export (and its HF base load) under this context manager
PATCH_MEGATRON_MODEL = "miles.utils.megatron_bridge_utils.patch_megatron_model"
MULTI_LORA_UTILS = f"{MEGATRON_UTILS}.multi_lora_utils"  # multi-LoRA v1
LORA_CHECKPOINT = f"{MEGATRON_UTILS}.lora.checkpoint"  # multi-LoRA v2
LORA_ACTOR = f"{MEGATRON_UTILS}.lora.actor"


@dataclass(frozen=True)
class Target:
    """One Miles function the plugin replaces or wraps.

    `consumers` are imported now and rebound; `late_consumers` are rebound when already imported,
    and otherwise bind the replaced definition when Miles imports them later (lazy imports).
    `optional` targets may be absent (their module or function); present, they must match.
    """

    handler: str  # key of the replacement factory in `bindings.HANDLERS`
    module: str
    name: str
    signature: str  # as `render_signature` prints it
    consumers: tuple[str, ...] = ()
    late_consumers: tuple[str, ...] = ()
    optional: bool = False

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Shape:
    """One known version of Miles' LoRA checkpoint surface."""

    name: str
    description: str
    lora_module: str  # where `save_lora_checkpoint`, `load_lora_adapter` and `is_lora_model` live
    gloo_flag: str  # the args attribute of megatron's gloo switch in this version
    targets: tuple[Target, ...]
    # dotted path of the context manager `fn(model)` Miles wraps Bridge calls in; None: unknown here
    bridge_model_context: str | None = None


def render_signature(function: Callable, *, defaults: bool = False) -> str:
    """`(a, b=..., *, c=...)`: parameter names, kinds and which have defaults; no annotations.

    `defaults=True` writes each default's `repr` instead of `...` (`(a, b=None, *, c=False)`), as
    `ast.unparse` writes a literal default in source: the stand-ins' signature table
    (the harness's `miles_standin/source_signatures.py`) compares defaults too.
    `inspect.signature` follows `__wrapped__`, so a function the plugin already wrapped still
    renders as Miles' own (that is what makes a second registration a no-op).
    """
    parts: list[str] = []
    star = False
    params = list(inspect.signature(function).parameters.values())
    for index, param in enumerate(params):
        if param.kind is param.VAR_POSITIONAL:
            parts.append(f"*{param.name}")
            star = True
            continue
        if param.kind is param.VAR_KEYWORD:
            parts.append(f"**{param.name}")
            continue
        if param.kind is param.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if param.default is param.empty:
            parts.append(param.name)
        else:
            parts.append(f"{param.name}={param.default!r}" if defaults else f"{param.name}=...")
        following = params[index + 1] if index + 1 < len(params) else None
        if param.kind is param.POSITIONAL_ONLY and (following is None or following.kind is not param.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


# --------------------------------------------------------------------------- the known shapes

_SAVE_LORA = "(model, args, save_dir, *, optimizer=..., opt_param_scheduler=..., iteration=...)"


def _model_targets() -> tuple[Target, ...]:
    """checkpoint.py / model.py targets: unchanged in every shape known so far."""
    return (
        Target(
            "save_checkpoint_with_lora",
            CHECKPOINT,
            "save_checkpoint_with_lora",
            "(iteration, model, optimizer, opt_param_scheduler)",
            consumers=(MODEL,),
        ),
        Target(
            "load_checkpoint",
            CHECKPOINT,
            "load_checkpoint",
            "(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt)",
            consumers=(MODEL, ACTOR),
            late_consumers=(DEBUG_WORKER,),
        ),
        Target(
            "initialize_model_and_optimizer",
            MODEL,
            "initialize_model_and_optimizer",
            "(args, role=..., checkpointing_context=...)",
            consumers=(ACTOR,),
        ),
        Target(
            "save",
            MODEL,
            "save",
            "(iteration, model, optimizer, opt_param_scheduler, checkpointing_context=..., non_persistent_ckpt=...)",
            consumers=(ACTOR,),
            late_consumers=(FT_IN_MEMORY,),
        ),
    )


def _wheel_model_targets() -> tuple[Target, ...]:
    """checkpoint.py / model.py targets of the miles-rl 0.0.2 wheel: model.py has
    `initialize_model_and_optimizer(args, role=...)` and `save(iteration, model, optimizer,
    opt_param_scheduler)`; the actor (which imports Ray and SGLang's runtime) is a late consumer."""
    return (
        Target(
            "save_checkpoint_with_lora",
            CHECKPOINT,
            "save_checkpoint_with_lora",
            "(iteration, model, optimizer, opt_param_scheduler)",
            consumers=(MODEL,),
        ),
        Target(
            "load_checkpoint",
            CHECKPOINT,
            "load_checkpoint",
            "(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt)",
            consumers=(MODEL,),
            late_consumers=(ACTOR, DEBUG_WORKER),
        ),
        Target(
            "initialize_model_and_optimizer",
            MODEL,
            "initialize_model_and_optimizer",
            "(args, role=...)",
            late_consumers=(ACTOR,),
        ),
        Target(
            "save",
            MODEL,
            "save",
            "(iteration, model, optimizer, opt_param_scheduler)",
            late_consumers=(ACTOR,),
        ),
    )


def _lora_targets(
    lora_module: str,
    load_signature: str,
    training_state: str | None,
    optional_state: bool,
    save_consumers: tuple[str, ...] = (CHECKPOINT,),
):
    targets = [
        Target(
            "save_lora_checkpoint",
            lora_module,
            "save_lora_checkpoint",
            _SAVE_LORA,
            consumers=save_consumers,
            late_consumers=(HF_EXPORT,),
        ),
        Target("load_lora_adapter", lora_module, "load_lora_adapter", load_signature, consumers=(CHECKPOINT,)),
    ]
    if training_state is not None:
        targets.append(
            Target(
                "load_training_state",
                lora_module,
                "_load_training_state",
                training_state,
                optional=optional_state,
            )
        )
    return tuple(targets)


def _multi_lora_v1_targets() -> tuple[Target, ...]:
    """Multi-LoRA v1. Optional: a Miles without `multi_lora_utils` runs single-LoRA only
    (the init hook refuses --multi-lora-n-adapters then); present, every signature must match."""
    return tuple(
        Target(handler, MULTI_LORA_UTILS, name, signature, optional=True)
        for handler, name, signature in (
            ("multi_lora_save", "save_multi_lora_checkpoints", "(args, model, adapter_steps, adapters)"),
            ("multi_lora_find_latest", "find_latest_checkpoint", "(ckpt_dir)"),
            ("multi_lora_register", "_register_adapter", "(adapter, model)"),
            ("multi_lora_load_adapters", "load_adapters", "(args, model, optimizer, adapters)"),
            ("multi_lora_deregister", "_deregister_adapter", "(adapter, args, model, optimizer)"),
        )
    )


def _multi_lora_v2_targets() -> tuple[Target, ...]:
    """Multi-LoRA v2: `lora/checkpoint.py`, bound by name in `lora/actor.py`. Optional, as v1's."""
    return (
        Target(
            "slot_save", LORA_CHECKPOINT, "save_slot", "(model, optimizer, slot, path)", (LORA_ACTOR,), optional=True
        ),
        Target(
            "slot_load",
            LORA_CHECKPOINT,
            "load_slot",
            "(model, optimizer, slot, path, load_optimizer)",
            (LORA_ACTOR,),
            optional=True,
        ),
    )


SHAPES: tuple[Shape, ...] = (
    Shape(
        "lora-package-2026-09",
        "lora/utils.py package module, load_lora_adapter(..., load_optimizer=True) (PR #3245), "
        "megatron's gloo switch renamed use_gloo_process_groups",
        LORA_UTILS_PACKAGE,
        "use_gloo_process_groups",
        _lora_targets(
            LORA_UTILS_PACKAGE,
            "(model, adapter_path, *, optimizer=..., opt_param_scheduler=..., load_optimizer=...)",
            "(adapter_dir, optimizer, opt_param_scheduler, load_optimizer=...)",
            optional_state=False,
        )
        + _model_targets()
        + _multi_lora_v2_targets(),
        PATCH_MEGATRON_MODEL,
    ),
    Shape(
        "positional-args-pr",
        "open PRs #2516/#2661: load_lora_adapter(model, args, adapter_path, ...); _load_training_state "
        "may be gone (#1792)",
        LORA_UTILS_PACKAGE,
        "use_gloo_process_groups",
        _lora_targets(
            LORA_UTILS_PACKAGE,
            "(model, args, adapter_path, *, optimizer=..., opt_param_scheduler=..., load_optimizer=...)",
            "(adapter_dir, optimizer, opt_param_scheduler, load_optimizer=...)",
            optional_state=True,
        )
        + _model_targets()
        + _multi_lora_v2_targets(),
        PATCH_MEGATRON_MODEL,
    ),
    Shape(
        "lora-utils-2026-08",
        "Miles at radixark/miles 31f1ca961a94: backends/megatron_utils/lora_utils.py; also the trees of PR #1792 "
        "and of working branches, which lack _load_training_state",
        LORA_UTILS_2026_08,
        "enable_gloo_process_groups",
        _lora_targets(
            LORA_UTILS_2026_08,
            "(model, adapter_path, *, optimizer=..., opt_param_scheduler=...)",
            "(adapter_dir, optimizer, opt_param_scheduler)",
            optional_state=True,  # the plugin replaces load_lora_adapter whole; it never calls it
        )
        + _model_targets()
        + _multi_lora_v1_targets(),
        PATCH_MEGATRON_MODEL,
    ),
    Shape(
        "miles-rl-0.0.2",
        "the miles-rl 0.0.2 wheel on PyPI: lora_utils.py as at 31f1ca961a94; model.py has "
        "initialize_model_and_optimizer(args, role=...) and save(iteration, model, optimizer, opt_param_scheduler) "
        "and binds save_lora_checkpoint by name; no multi-LoRA, hf_export or ft/",
        LORA_UTILS_2026_08,
        "enable_gloo_process_groups",
        _lora_targets(
            LORA_UTILS_2026_08,
            "(model, adapter_path, *, optimizer=..., opt_param_scheduler=...)",
            "(adapter_dir, optimizer, opt_param_scheduler)",
            optional_state=True,
            save_consumers=(CHECKPOINT, MODEL),
        )
        + _wheel_model_targets(),
        PATCH_MEGATRON_MODEL,
    ),
)
SHAPES_BY_NAME = {shape.name: shape for shape in SHAPES}


# --------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class Difference:
    """Why one target of a shape does not match what is running."""

    module: str
    name: str
    found: str  # a rendered signature, "absent", or "module cannot be imported: ..."
    expected: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}: found {self.found}, expected {self.expected}"


class UnknownMilesShape(MilesLoraCkptError, ValueError):
    """The running Miles matches no known shape; raised before anything is patched."""

    def __init__(self, differences: dict[str, list[Difference]]):
        self.differences = differences
        lines = ["miles-lora-ckpt does not know this Miles, so it patched nothing:"]
        present = {name: diffs for name, diffs in differences.items() if not _layout_missing(diffs)}
        for name, diffs in (present or differences).items():
            lines.append(
                f"  against shape {name!r} ({SHAPES_BY_NAME[name].description}):"
                if name in SHAPES_BY_NAME
                else f"  against shape {name!r}:"
            )
            lines += [f"    {d}" for d in diffs]
        absent = sorted(set(differences) - set(present)) if present else []
        if absent:
            lines.append(f"  shapes whose LoRA module is absent here: {', '.join(absent)}")
        lines.append(
            "Upgrade miles-lora-ckpt, or report the signatures above; running without the plugin is stock Miles."
        )
        super().__init__("\n".join(lines))


def _layout_missing(diffs: list[Difference]) -> bool:
    return bool(diffs) and diffs[0].found.startswith("module cannot be imported") and diffs[0].name == "*"


def detect_shape(import_module: Callable = importlib.import_module, shapes: tuple[Shape, ...] = SHAPES) -> Shape:
    """The first shape every target of which matches the running Miles; else UnknownMilesShape."""
    report: dict[str, list[Difference]] = {}
    for shape in shapes:
        differences = shape_differences(shape, import_module)
        if not differences:
            return shape
        report[shape.name] = differences
    raise UnknownMilesShape(report)


def shape_differences(shape: Shape, import_module: Callable = importlib.import_module) -> list[Difference]:
    """Every way the running Miles differs from `shape` (empty: it is this shape)."""
    try:
        import_module(shape.lora_module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not this layout"
        return [Difference(shape.lora_module, "*", f"module cannot be imported: {_short(exc)}", "importable")]
    differences = []
    for target in shape.targets:
        found = _found_signature(target, import_module)
        if found is None:
            continue  # an optional target that is absent
        if found != target.signature:
            differences.append(Difference(target.module, target.name, found, target.signature))
    return differences


def _found_signature(target: Target, import_module: Callable) -> str | None:
    try:
        module = import_module(target.module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the target is not there
        return None if target.optional else f"module cannot be imported: {_short(exc)}"
    function = getattr(module, target.name, None)
    if function is None:
        return None if target.optional else "absent"
    if not callable(function):
        return f"not a function ({type(function).__name__})"
    try:
        return render_signature(function)
    except (TypeError, ValueError) as exc:
        return f"signature unreadable: {exc}"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
