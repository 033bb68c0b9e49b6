"""megatron's OptimizerParamScheduler: state as JSON, restore, or reposition from the iteration."""

from __future__ import annotations

from miles_lora_ckpt.core.hyperparameters import SCHEDULER_FIELDS
from miles_lora_ckpt.core.jsoncodec import from_json, to_json

__all__ = ["reposition_scheduler", "restore_scheduler", "scheduler_state"]


def scheduler_state(scheduler) -> dict | None:
    """`scheduler.state_dict()` as JSON, or None for no scheduler."""
    return None if scheduler is None else to_json(scheduler.state_dict(), "scheduler")


# the fields megatron's `load_state_dict` checks against the scheduler's own (`_check_and_set`)
CHECKED_FIELDS = SCHEDULER_FIELDS


def restore_scheduler(scheduler, state: dict, *, checkpoint_fields: bool = False) -> None:
    """Load the saved JSON `state` into `scheduler`; megatron then steps to the saved `num_steps`.

    Megatron steps *by* the saved count from wherever the scheduler is. So it is put back to 0
    first, and a scheduler that already stepped (a slot retired and re-registered) lands there too.

    With `checkpoint_fields`, the checkpoint's schedule fields win, as with megatron's
    `use_checkpoint_opt_param_scheduler`: they are set first, so megatron's check passes. Without
    it, megatron's check decides; the caller may have put the launch's values into `state`.
    Returns None; megatron's own error propagates when its check fails.
    """
    state = from_json(state)
    if checkpoint_fields:
        for key in CHECKED_FIELDS:
            if key in state and hasattr(scheduler, key):
                setattr(scheduler, key, state[key])
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def reposition_scheduler(scheduler, iteration: int, increment_per_iteration: int) -> None:
    """Put a fresh scheduler where `iteration` iterations would have left it.

    No saved state is used: it steps by `iteration * increment_per_iteration` from 0.
    """
    scheduler.num_steps = 0
    scheduler.step(increment=iteration * increment_per_iteration)
