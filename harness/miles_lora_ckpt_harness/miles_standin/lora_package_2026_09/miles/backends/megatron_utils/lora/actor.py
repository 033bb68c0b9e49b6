"""Stand-in of miles/backends/megatron_utils/lora/actor.py (multi-LoRA v2, PR #2840): the slot lifecycle.

`MultiLoRATrainRayActor` loads, unloads and saves slots at the paths its caller names (the
stand-in's controller names `{adapter save}/current`; no directory scan picks a resume step). The
adapter's step after a load is the largest Adam step of its children (what v2 saves). A fresh slot
(nothing to load) gets the adapter's initial weights and only that slot's masters refreshed; an
unloaded slot is saved, cleared and its moments zeroed (the whole-chain master refresh of v2 is in
`load_slot`). Miles' description does not cover these two paths; the stand-in takes the
narrowest reading.
Stand-in simplification: Miles' actor also runs forward/backward; here `common.multi_lora` does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from miles.backends.megatron_utils.lora.checkpoint import load_slot, save_slot

from miles_lora_ckpt_harness.miles_standin.common import multi_lora as common
from miles_lora_ckpt_harness.miles_standin.common import slot_stock as stock
from miles_lora_ckpt_harness.sim import multi_lora_model as slot_model

CHECKPOINT_NAME = "current"


def checkpoint_path(adapter) -> Path | None:
    return None if adapter.config.save is None else Path(adapter.config.save) / CHECKPOINT_NAME


def refresh_slot_masters(optimizer, slot: int) -> None:
    """Copy the slot's bf16 params into its children's fp32 masters (no co-tenant touched)."""
    with torch.no_grad():
        for child in slot_model.slot_children(optimizer, slot):
            for model_group, main_group in zip(
                getattr(child, "float16_groups", []), getattr(child, "fp32_from_float16_groups", []), strict=False
            ):
                for model_param, main_param in zip(model_group, main_group, strict=True):
                    main_param.data.copy_(model_param.data.float())


class MultiLoRATrainRayActor:
    def __init__(self, args, model, optimizer):
        self.args, self.model, self.optimizer = args, model, optimizer

    def load_slot(self, adapter) -> int:
        """Register `adapter` into its slot: resume from its named checkpoint, or start it fresh."""
        common.install_slot_scheduler(self.args, self.optimizer, adapter, 0)
        path = checkpoint_path(adapter)
        if path is not None and path.exists():
            load_slot(self.model, self.optimizer, adapter.slot, str(path), load_optimizer=True)
            step = common.slot_adam_step(self.optimizer, adapter.slot)
            scheduler = self.optimizer.miles_slot_schedulers[adapter.slot]
            if step and scheduler.num_steps == 0:  # v2 saves no scheduler: reposition it, as v1 did
                scheduler.step(increment=step * adapter.config.adapter_global_batch_size)
        else:
            stock.init_adapter_slot(
                self.model, adapter.slot, adapter.name, adapter.config.rank, adapter.config.alpha, fresh=True
            )
            refresh_slot_masters(self.optimizer, adapter.slot)
            step = 0
        adapter.step = step
        return step

    def save_slot(self, adapter) -> None:
        path = checkpoint_path(adapter)
        if path is not None:
            save_slot(self.model, self.optimizer, adapter.slot, str(path))

    def unload_slot(self, adapter) -> None:
        """Retire: the final save, then the slot cleared and its optimizer state zeroed."""
        self.save_slot(adapter)
        slot_model.clear_adapter_slot(self.model, adapter.slot)
        stock.zero_optimizer_state_for_adapter(self.optimizer, self.model, adapter.slot)
        slot_model.zero_adapter_slot_grads(self.model, adapter.slot)
        common.drop_slot_scheduler(self.optimizer, adapter.slot)
