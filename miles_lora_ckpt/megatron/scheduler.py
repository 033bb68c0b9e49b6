"""megatron's OptimizerParamScheduler: state as JSON, restore, or reposition from the iteration."""

from __future__ import annotations

from miles_lora_ckpt.core.jsoncodec import from_json, to_json


def scheduler_state(scheduler) -> dict | None:
    return None if scheduler is None else to_json(scheduler.state_dict(), "scheduler")


def restore_scheduler(scheduler, state: dict) -> None:
    """Load saved state; megatron's `load_state_dict` then steps to the saved `num_steps`.

    megatron steps *by* the saved count from wherever the scheduler is: it is put back to 0 first,
    so a scheduler that already stepped (a slot retired and re-registered) lands exactly there too.
    """
    scheduler.num_steps = 0
    scheduler.load_state_dict(from_json(state))


def reposition_scheduler(scheduler, iteration: int, increment_per_iteration: int) -> None:
    """Put a fresh scheduler where `iteration` iterations would have left it (no saved state used)."""
    scheduler.num_steps = 0
    scheduler.step(increment=iteration * increment_per_iteration)
