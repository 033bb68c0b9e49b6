"""Invariants of a training-state file: a self-consistent but wrong one must not load.

A file of manifest role `training-state`, such as the single-LoRA saver's `training_state.json`,
is JSON written through `jsoncodec`::

    {"iteration": 12, "generation": "<attempt id>",          generation: format v2 only
     "scheduler": {... megatron OptimizerParamScheduler state ...} | null,
     "optimizer_children": {"<child>:<coordinate>": {... a child's state_dict(), param groups ...}}}

Checked on every read, by the loader and `verify` alike:
- `iteration` and, in v2, `generation` are the manifest's, so a copied state is refused;
- every number is finite, and every tagged value passes `jsoncodec.check_tags`;
- the scheduler holds every key megatron's scheduler reads (`SCHEDULER_KEYS`), in styles megatron
  knows (`LR_DECAY_STYLES`, `WD_INCR_STYLES`), with non-negative counters and rates;
- a scheduler that never stepped belongs to iteration 0 (rollout 0 trains before its save, so
  iteration 0 may have stepped);
- param group hyperparameters are in the range torch's optimizers accept (`NON_NEGATIVE`; betas in
  [0, 1)).

Every refusal is a ValueError naming the field by its path in the file.
"""

from __future__ import annotations

from typing import Any

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.jsoncodec import FLOAT_TAG, SCALAR_TAG, TUPLE_TAG, check_tags

__all__ = ["check"]

NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "max_lr", "min_lr", "lr_mult", "wd_mult", "dampening")
SCHEDULER_COUNTERS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
# What megatron's OptimizerParamScheduler.load_state_dict reads: each entry is one value, under its
# name or one of megatron's older aliases (megatron 0.16 and 0.19 alike).
SCHEDULER_KEYS = (
    ("max_lr", "start_lr"),
    ("min_lr",),
    ("lr_warmup_steps", "warmup_iter", "warmup_steps"),
    ("lr_decay_steps", "end_iter", "decay_steps"),
    ("lr_decay_style", "decay_style"),
    ("num_steps",),
)
SCHEDULER_WD_KEYS = ("end_wd", "wd_incr_steps", "wd_incr_style")  # read when `start_wd` is there
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WD_INCR_STYLES = ("constant", "linear", "cosine")
_STYLES = {"lr_decay_style": LR_DECAY_STYLES, "decay_style": LR_DECAY_STYLES, "wd_incr_style": WD_INCR_STYLES}


def check(state: Any, *, iteration: int, generation: str, format_version: int) -> None:
    """Raise ValueError unless `state`, parsed JSON, satisfies the module docstring's invariants.

    `iteration`, `generation` and `format_version` are the manifest's.
    """
    bounded.mapping(state, "training state")
    _all_numbers_finite(state)
    check_tags(state, "training state")
    saved_iteration = bounded.integer(state.get("iteration"), "iteration", high=bounded.INT64_MAX)
    if saved_iteration != iteration:
        raise ValueError(f"iteration is {saved_iteration}, the manifest says {iteration}")
    if format_version >= 2:
        if "generation" not in state:
            raise ValueError("has no 'generation' key (a format v2 training state names its generation)")
        if state["generation"] != generation:
            raise ValueError(
                f"belongs to generation {bounded.show(state['generation'])}, not to {generation} "
                "(copied from another generation)"
            )
    if state.get("scheduler") is not None:
        _check_scheduler(bounded.mapping(state["scheduler"], "scheduler"), iteration)
    children = bounded.mapping(state.get("optimizer_children", {}), "optimizer_children")
    for name, child in children.items():
        for where, group in _param_groups(child, f"optimizer_children[{name!r}]"):
            _check_param_group(group, where)


def _check_scheduler(scheduler: dict, iteration: int) -> None:
    for key, value in scheduler.items():
        if _is_number(value):
            bounded.number(_plain(value), f"scheduler.{key}", low=0)
    required = [*SCHEDULER_KEYS, *((k,) for k in SCHEDULER_WD_KEYS if "start_wd" in scheduler)]
    for names in required:
        if not any(name in scheduler for name in names):
            also = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
            raise ValueError(f"scheduler has no {names[0]!r}{also}, which megatron's scheduler reads")
    for key, known in _STYLES.items():
        if key in scheduler and scheduler[key] not in known:
            raise ValueError(
                f"scheduler.{key} is {bounded.show(scheduler[key])}, not a style megatron knows {list(known)}"
            )
    num_steps = bounded.integer(_plain(scheduler["num_steps"]), "scheduler.num_steps")
    for key in SCHEDULER_COUNTERS:
        if key in scheduler and scheduler[key] is not None:
            bounded.integer(_plain(scheduler[key]), f"scheduler.{key}")
    if num_steps == 0 and iteration > 0:
        raise ValueError(
            f"scheduler.num_steps is 0 at iteration {iteration}: a scheduler that never stepped does not "
            "belong to a later iteration"
        )


def _check_param_group(group: dict, where: str) -> None:
    for key in NON_NEGATIVE:
        if key in group and group[key] is not None:
            bounded.number(_plain(group[key]), f"{where}.{key}", low=0)
    if "betas" in group and group["betas"] is not None:
        betas = group["betas"]
        betas = betas.get(TUPLE_TAG) if isinstance(betas, dict) else betas
        if not isinstance(betas, list) or not betas:
            raise ValueError(f"{where}.betas is {bounded.show(group['betas'])}, not a list of numbers")
        for index, beta in enumerate(betas):
            value = bounded.number(_plain(beta), f"{where}.betas[{index}]", low=0)
            if value >= 1:
                raise ValueError(f"{where}.betas[{index}] is {value}, outside [0, 1)")


def _param_groups(state: Any, where: str):
    """Every `param_groups` entry anywhere in a child's (nested) state dict."""
    stack = [(state, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "param_groups" and isinstance(value, list):
                    for index, group in enumerate(value):
                        yield f"{path}.param_groups[{index}]", bounded.mapping(group, f"{path}.param_groups[{index}]")
                else:
                    stack.append((value, f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((value, f"{path}[{index}]") for index, value in enumerate(item))


def _all_numbers_finite(state: Any) -> None:
    """Refuse the NaN and Inf that `jsoncodec` tags, anywhere in `state`."""
    stack = [(state, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            if FLOAT_TAG in item:
                raise ValueError(f"{path.lstrip('.') or 'value'} is {bounded.show(item[FLOAT_TAG])} (not finite)")
            stack.extend((value, f"{path}.{key}") for key, value in item.items())
        elif isinstance(item, list):
            stack.extend((value, f"{path}[{index}]") for index, value in enumerate(item))


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) or (
        isinstance(value, dict) and SCALAR_TAG in value
    )


def _plain(value: Any) -> Any:
    """A number, or the number inside a scalar-tensor tag."""
    return value[SCALAR_TAG] if isinstance(value, dict) and SCALAR_TAG in value else value
