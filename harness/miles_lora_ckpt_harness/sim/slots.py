"""Independent adapter slots on the harness model, trained one slot at a time as Miles' multi-LoRA does.

A run built with `SimConfig(slots=N)` deals its layers round-robin to N slots (`SimConfig.slot_of`)
and gives every slot its own children under one LayerWiseDistributedOptimizer
(`optimizer.miles_slot_child_indices`). `SlotTrainer` adds what Miles' multi-LoRA step adds,
written from its description and not from Miles' code:

- a slot's step runs the forward with only that slot's adapters (every other adapter bypassed: the
  base alone), so a slot's training never depends on another slot's weights;
- only that slot's children step (`prepare_grads`, `step_with_ready_grads`, no clipping across
  slots), then the chain's `allgather_params` (layer-wise: each rank's owned params to all);
- every slot has its own scheduler over its children's param groups (Miles'
  `miles_slot_schedulers[slot]`), stepped with the slot;
- a slot's data is a function of (slot, its own step), so slots can sit at different steps.

Slot k at its step s is then the same bytes whatever the other slots did: what lets a slot resume,
retire and come back independently, bit for bit.
"""

from __future__ import annotations

import re

import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from miles_lora_ckpt_harness.sim.model import LoraLinear
from miles_lora_ckpt_harness.sim.train import SimRun, _scheduler, batch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _SlotGroups:
    """The scheduler's view of one slot: only its children's param groups (Miles' `_SlotParamGroups`)."""

    def __init__(self, children):
        self.children = children

    @property
    def param_groups(self):
        return [group for child in self.children for group in child.param_groups]


class SlotTrainer:
    """Per-slot training of a built multi-slot run (`config.slots > 1`, or 1 for a lone slot)."""

    def __init__(self, run: SimRun):
        self.run = run
        self.config = run.config
        indices = getattr(run.optimizer, "miles_slot_child_indices", None)
        if indices is None:
            raise ValueError("the run has no per-slot optimizer children: build it with SimConfig(slots=N, layer_wise)")
        self.children = {int(slot): list(ix) for slot, ix in indices.items()}
        chained = run.optimizer.chained_optimizers
        self.schedulers = {
            slot: _scheduler(self.config, _SlotGroups([chained[i] for i in ix])) for slot, ix in self.children.items()
        }

    @property
    def slots(self) -> list[int]:
        return sorted(self.children)

    def adapter_filter(self, slot: int):
        """`name -> bool`: the adapter weights of `slot` (the layers dealt to it)."""

        def accepts(name: str) -> bool:
            match = _LAYER.search(name)
            return match is not None and self.config.slot_of(int(match.group(1))) == slot

        return accepts

    def step(self, slot: int, step: int) -> float:
        """Train `slot` one step (its `step`-th); returns the mean loss over ranks."""
        run = self.run
        self._enable_only(slot)
        try:
            for chunk in run.model:
                chunk.zero_grad_buffer()
            run.optimizer.zero_grad()
            loss = torch.zeros(())
            for vp_stage, chunk in enumerate(run.model):
                inputs, target = batch(self.config, step, f"slot{slot}/vp{vp_stage}/{_data_rank()}")
                output = chunk(inputs.to(self.config.torch_dtype))
                loss = loss + torch.nn.functional.mse_loss(output.float(), target)
            loss.backward()
            finalize_model_grads(run.model)
        finally:
            self._enable_only(None)
        chained = run.optimizer.chained_optimizers
        children = [chained[i] for i in self.children[slot]]
        for child in children:
            child.prepare_grads()
        for child in children:
            child.step_with_ready_grads()
        run.optimizer.allgather_params()
        self.schedulers[slot].step(increment=1)
        total = loss.detach().float().reshape(1).clone()
        torch.distributed.all_reduce(total)
        return total.item() / torch.distributed.get_world_size()

    def clear(self, slot: int) -> None:
        """Miles' `clear_adapter_slot`, as the harness does it: the slot's adapter weights zeroed."""
        with torch.no_grad():
            for module in self._slot_linears(slot):
                for param in [*module.lora_A.parameters(), *module.lora_B.parameters()]:
                    param.zero_()

    def _enable_only(self, slot: int | None) -> None:
        for index, module in self._linears():
            module.adapter_enabled = slot is None or self.config.slot_of(index) == slot

    def _slot_linears(self, slot: int):
        return [m for index, m in self._linears() if self.config.slot_of(index) == slot]

    def _linears(self):
        for inner in self.run.inner_models:
            for layer in inner.layers:
                for module in layer.modules():
                    if isinstance(module, LoraLinear) and module.lora_A is not None:
                        yield layer.global_index, module


def _data_rank() -> str:
    from megatron.core import parallel_state

    return f"dp{parallel_state.get_data_parallel_rank()}"
