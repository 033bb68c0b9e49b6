"""The train side of the rollout data state: which staged state a save of rollout N commits.

The rollout manager stages rollout N's state once its draw is complete, before N is trained, with
the sync and the async driver alike (`integration.data_source`). A save of generation N, on rank 0,
takes exactly that state (`staged_for_save`), and the saver commits it inside generation N. When it
is missing or torn, `data_state.missing` decides: refuse (the default) or warn.

Multi-LoRA does the same per slot (`staged_for_slot`): the slot save of an adapter's step k takes
the state its data source staged as step k (`integration.multi_lora_data_source`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles_lora_ckpt.core import data_state
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.integration.config import MissingDataState, PluginConfig

__all__ = [
    "DataStateRefused",
    "HOOK",
    "ROLLOUT_HOOK",
    "MULTI_HOOK",
    "MULTI_ROLLOUT_HOOK",
    "staged_for_save",
    "staged_for_slot",
    "startup_note",
]

log = logging.getLogger("miles_lora_ckpt.integration")

HOOK = "miles_lora_ckpt.hooks.CheckpointedDataSource"  # Miles' --data-source-path
ROLLOUT_HOOK = "miles_lora_ckpt.hooks.generate_rollout"  # set by the data source itself
MULTI_HOOK = "miles_lora_ckpt.hooks.CheckpointedMultiLoRADataSource"  # multi-LoRA's --data-source-path
MULTI_ROLLOUT_HOOK = "miles_lora_ckpt.hooks.generate_multi_lora_rollout"  # set by the multi-LoRA data source


class DataStateRefused(MilesLoraCkptError, RuntimeError):
    """The rollout data state cannot be saved or restored as configured; the message says why."""


def configured(args) -> bool:
    """Whether this run's rollout manager uses the plugin's data source."""
    return getattr(args, "data_source_path", None) == HOOK


def startup_note(args) -> str:
    """Init hook, rank 0: one line on whether generations will hold the rollout data state."""
    if configured(args):
        return f"the rollout data state of rollout N is committed in generation N (--data-source-path {HOOK})"
    return (
        f"WARNING: --data-source-path is {getattr(args, 'data_source_path', None)!r}, not {HOOK}: generations hold "
        "no rollout data state, and a resume restarts the prompt cursor and loses the buffer as stock Miles does"
    )


def staged_for_save(config: PluginConfig, args, root: str | Path, iteration: int) -> dict | None:
    """Rank 0, at a save of rollout `iteration`: the staged data state to commit with it (None
    when the plugin's data source is not configured, or missing under `data_state.missing = warn`).

    Raises DataStateRefused naming the file when it is missing or torn under 'refuse'."""
    if not configured(args):
        return None
    return _read(config, root, iteration, HOOK, f"Generation {iteration}")


def staged_for_slot(config: PluginConfig, args, root: str | Path, step: int, slot: int) -> dict | None:
    """Rank 0, at a multi-LoRA slot save of step `step` into the slot root `root`: the adapter's
    staged data state to commit with it. None when the plugin's multi-LoRA data source is not
    configured, at step 0, or when the state is missing under 'warn'. Raises DataStateRefused as
    `staged_for_save` does."""
    if getattr(args, "data_source_path", None) != MULTI_HOOK or int(step) == 0:
        return None
    return _read(config, root, int(step), MULTI_HOOK, f"The slot {slot} generation of step {step}")


def _read(config: PluginConfig, root, iteration: int, hook: str, what: str) -> dict | None:
    try:
        return data_state.read_staged(root, iteration)
    except data_state.DataStateMissing as exc:
        if config["data_state.missing"] == MissingDataState.WARN:
            log.warning("miles-lora-ckpt: %s; %s is committed WITHOUT its rollout data state", exc, what)
            return None
        raise DataStateRefused(
            f"{exc}. {what} would resume the rollout side at another prompt than an "
            "uninterrupted run, so it is not committed (the rollout manager must run --data-source-path "
            f"{hook} with the same --save and MILES_LORA_CKPT_CONFIG; set data_state.missing = 'warn' to "
            "commit without it)"
        ) from exc
