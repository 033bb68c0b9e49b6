"""Retire a slot: its final save, then its optimizer state reset; co-tenant slots untouched.

Miles' deregistration saves the leaving adapter, even when that step was already saved. It then
clears the slot, zeroes its optimizer state and refreshes the whole chain's masters from bf16,
which changes every co-tenant's masters. Here `retire_slot` saves through `save_slot`, where the
same step again replaces it atomically. `reset_slot_optimizer` touches only the slot's own children.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.savers.multi_lora.save import save_slot
from miles_lora_ckpt.savers.multi_lora.slot import SlotSave, SlotSpec

__all__ = ["reset_slot_optimizer", "retire_slot"]


def retire_slot(
    model,
    args,
    slot: SlotSpec,
    save: SlotSave,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    consensus: Consensus | None = None,
    clear_slot: Callable[[], None] | None = None,
) -> str:
    """Collective. The final save of a leaving slot, then its state cleared; returns the generation.

    Saves exactly as `save_slot` with the same `slot` and `save`. A step already saved gets a new
    generation, and its reader links are swapped atomically. Only after that save is published on
    every rank come `clear_slot()` (the caller's, e.g. Miles' `clear_adapter_slot`) and
    `reset_slot_optimizer(optimizer, slot.optimizer_children, model)`.

    A failed save raises the same CheckpointError on every rank before anything is cleared. A
    failed clear raises it after the save. The scheduler is the caller's to drop.
    """
    consensus = consensus or Consensus.default()
    generation = save_slot(
        model, args, slot, save, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler, consensus=consensus
    )
    # clear: the slot's weights (the caller's), then its optimizer children only; agreed
    cleared = attempt(_clear, clear_slot, optimizer, slot.optimizer_children, model)
    consensus.agree("retire", cleared)
    return generation


def _clear(clear_slot, optimizer, optimizer_children, model) -> None:
    if clear_slot is not None:
        clear_slot()
    if optimizer is not None and optimizer_children is not None:
        reset_slot_optimizer(optimizer, optimizer_children, model)


def reset_slot_optimizer(optimizer, optimizer_children: Iterable[int], model=None) -> None:
    """Local. Zero every moment and step of the slot's `optimizer_children`; refresh their masters.

    The fp32 masters are copied from their model parameters, so call it after the slot was
    cleared. Every other child stays bit-identical. Returns None; raises ValueError for a child
    index the chain does not have. `model` is not used.
    """
    children = chain.select(optimizer, optimizer_children)
    with torch.no_grad():
        for child in children:
            inner = getattr(child.optimizer, "optimizer", None)
            for state in getattr(inner, "state", {}).values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
            for group in getattr(inner, "param_groups", []):
                if isinstance(group.get("step"), torch.Tensor):
                    group["step"].zero_()
                elif "step" in group:
                    group["step"] = 0
            # only this child's masters, from its own model params (never the whole chain's)
            child.optimizer.reload_model_params()
