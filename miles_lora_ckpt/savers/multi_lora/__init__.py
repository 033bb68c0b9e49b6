"""Multi-LoRA: one save root per adapter slot, full per-slot state, through the crash-safe protocol.

A multi-LoRA run trains several adapters ("slots") on one base model. Each has its own save root
("slot root") and cadence, and comes and goes while the job runs. A slot root is an ordinary save
root of `core.protocol` plus *reader names*: relative symlinks such as Miles v1's `step_N` that
the publish swaps atomically (layout in `naming`; guide in docs/multi-lora.md).

Every function here is collective: every rank calls it with the same arguments. When anything
fails anywhere, it raises the same CheckpointError on every rank.

A slot is `SlotSpec`: its root, index, `adapter_filter` over the adapter parameter names, and
optimizer children. What a slot save writes is `SlotSave`: step, keep, PEFT export, reader names,
data state. The empty-shard guard: the filter must match at least one adapter parameter, and
exactly the parameters the children step. Otherwise the call fails before anything changes.

- `save_slot` / `save_slot_checkpoint`: the slot's adapter shards, its children's fp32 masters,
  every moment, steps and param groups, and its scheduler, as one new generation.
- `load_slot` / `load_slot_checkpoint`: the newest intact generation or a named one. It restores
  exactly that slot and never touches a co-tenant's state. `rename_slot` resumes a generation
  saved from another slot index (`remap`).
- `latest_slot_step`: the step of the generation a load would choose, or None.
- `retire_slot`: the final save of a leaving slot, then the slot's optimizer state reset.
"""

from miles_lora_ckpt.savers.multi_lora.load import latest_slot_step, load_slot, load_slot_checkpoint
from miles_lora_ckpt.savers.multi_lora.naming import (
    SLOT_SAVER,
    check_reader_name,
    reader_links,
    v1_step_name,
)
from miles_lora_ckpt.savers.multi_lora.remap import SlotRenamer, rename_by_pattern
from miles_lora_ckpt.savers.multi_lora.retire import reset_slot_optimizer, retire_slot
from miles_lora_ckpt.savers.multi_lora.save import save_slot, save_slot_checkpoint
from miles_lora_ckpt.savers.multi_lora.slot import SlotSave, SlotSpec

__all__ = [
    "SLOT_SAVER",
    "SlotRenamer",
    "SlotSave",
    "SlotSpec",
    "check_reader_name",
    "latest_slot_step",
    "load_slot",
    "load_slot_checkpoint",
    "reader_links",
    "rename_by_pattern",
    "reset_slot_optimizer",
    "retire_slot",
    "save_slot",
    "save_slot_checkpoint",
    "v1_step_name",
]
