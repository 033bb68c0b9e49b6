"""What the stand-in train actor's `send_ckpt` sends (shared by every shape's `actor.py`).

Kept out of `common/training.py`, which the stand-in's `model.py` and `checkpoint.py` import: this
function calls the shape's `ft/in_memory_checkpoint.py`, which imports `model.py`, so it cannot live in
`training` without an import circle. Miles is imported inside the function, as in `training`.
"""

from __future__ import annotations


def in_memory_checkpoint(actor):
    """What the train actor's `send_ckpt` sends in Miles: an in-memory checkpoint of the live state at the
    last trained rollout (Miles sends it to an alive rank of the cross-cell group; the stand-in has one cell
    and returns it). Stock LoRA fails here: its save goes to disk and leaves the manager empty."""
    from miles.backends.megatron_utils.ft.in_memory_checkpoint import save_to_memory

    return save_to_memory(
        iteration=actor._last_rollout_id,
        model=actor.model,
        optimizer=actor.optimizer,
        opt_param_scheduler=actor.opt_param_scheduler,
    )
