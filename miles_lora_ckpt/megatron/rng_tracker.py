"""Megatron's tensor-parallel RNG tracker (`get_cuda_rng_tracker()`): its states out and back in.

Dropout inside tensor-parallel regions draws from the tracker's forked states, not from torch's
default generator. There is one per name (`model-parallel-rng`, `expert-parallel-rng`, ...), so a
bit-exact resume restores them too. Megatron's own checkpoint saves `get_states()` and restores it
with `set_states()`. So do we, as `{name: uint8 tensor}`; `core.rng_state` stores them. A
graph-safe tracker holds `torch.Generator`s, whose states are read and set in place.
"""

from __future__ import annotations

import torch

__all__ = ["capture", "check_restorable", "restore"]


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def capture() -> dict[str, torch.Tensor] | None:
    """The tracker's states now (copies), or None when it was never initialised (no seed set)."""
    tracker = _tracker()
    initialised = getattr(tracker, "is_initialized", None)
    states = tracker.get_states()
    if (initialised() if callable(initialised) else bool(states)) is False:
        return None
    return {str(name): _state_bytes(value) for name, value in states.items()}


def check_restorable(saved: dict[str, torch.Tensor] | None) -> None:
    """Check that the states `saved` by `capture` can be set into this process's tracker.

    Returns None, also for `saved=None`. Raises ValueError for a state whose size differs from the
    live one of its name (another device's generator). It also raises when this tracker is
    graph-safe and holds a generator the checkpoint lacks.
    """
    if saved is None:
        return
    live = _tracker().get_states()
    generators = [n for n, v in live.items() if isinstance(v, torch.Generator)]
    missing = sorted(set(generators) - set(saved))
    if missing:
        raise ValueError(f"megatron's RNG tracker holds generator state(s) {missing} the checkpoint lacks")
    for name, state in saved.items():
        if name in live and state.numel() != _state_bytes(live[name]).numel():
            raise ValueError(
                f"megatron's RNG tracker state {name!r} has {_state_bytes(live[name]).numel()} bytes here, "
                f"the checkpoint's {state.numel()}"
            )


def restore(saved: dict[str, torch.Tensor] | None) -> None:
    """Set the tracker to `saved` (as megatron's checkpoint load does); None leaves it as it is."""
    if saved is None:
        return
    tracker = _tracker()
    live = tracker.get_states()
    if any(isinstance(v, torch.Generator) for v in live.values()):
        for name, state in saved.items():
            if isinstance(live.get(name), torch.Generator):
                live[name].set_state(state.clone())
        return
    tracker.set_states({name: state.clone() for name, state in saved.items()})


def _state_bytes(value) -> torch.Tensor:
    state = value.get_state() if isinstance(value, torch.Generator) else value
    return state.detach().to("cpu", torch.uint8).clone()
