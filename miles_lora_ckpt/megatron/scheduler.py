"""megatron's OptimizerParamScheduler: state as JSON, restore, or reposition from the iteration."""

from __future__ import annotations

from miles_lora_ckpt.core.hyperparameters import SCHEDULER_FIELDS
from miles_lora_ckpt.core.jsoncodec import from_json, to_json


def scheduler_state(scheduler) -> dict | None:
    return None if scheduler is None else to_json(scheduler.state_dict(), "scheduler")


# the fields megatron's `load_state_dict` checks against the scheduler's own (`_check_and_set`)
CHECKED_FIELDS = SCHEDULER_FIELDS


def restore_scheduler(scheduler, state: dict, *, checkpoint_fields: bool = False) -> None:
    """Load saved state; megatron's `load_state_dict` then steps to the saved `num_steps`.

    megatron steps *by* the saved count from wherever the scheduler is: it is put back to 0 first,
    so a scheduler that already stepped (a slot retired and re-registered) lands exactly there too.
    `checkpoint_fields`: the checkpoint's schedule fields are intended (what megatron's
    `use_checkpoint_opt_param_scheduler` does): they are set first, so its check passes whatever
    the scheduler's flags. Without it, megatron's check decides (the caller may have put the
    launch's values into `state`).
    """
    state = from_json(state)
    if checkpoint_fields:
        for key in CHECKED_FIELDS:
            if key in state and hasattr(scheduler, key):
                setattr(scheduler, key, state[key])
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def reposition_scheduler(scheduler, iteration: int, increment_per_iteration: int) -> None:
    """Put a fresh scheduler where `iteration` iterations would have left it (no saved state used)."""
    scheduler.num_steps = 0
    scheduler.step(increment=iteration * increment_per_iteration)
