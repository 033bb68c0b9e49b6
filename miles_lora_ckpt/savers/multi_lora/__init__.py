"""Multi-LoRA: one save root per adapter slot, full per-slot state, through the crash-safe protocol.

A multi-LoRA run trains several adapters ("slots") on one base model; each has its own save root
("slot root"), its own cadence, and comes and goes while the job runs. Every function here is
collective (every rank calls it, with the same arguments) and raises the same CheckpointError on
every rank when anything fails anywhere.

A slot root is an ordinary save root of `core.protocol` (see `naming` for the layout), whose
generations are written by the saver `multi-lora-slot`, plus *reader names*: relative symlinks
(e.g. Miles v1's `step_N`, or a Miles v2 checkpoint name) that the publish points at the new
generation, swapped atomically together with it::

    <slot root>/
      gen-000000006-3f2a9c1e0b7d4e55/   a committed slot generation (iteration = the slot's step)
      step_6 -> gen-000000006-3f2a...   reader name (relative symlink), swapped atomically
      latest_generation.json            tracker; .writer-lease.json; .staging-<id>/ attempts

What a slot is: `adapter_filter(name) -> bool` over the adapter parameter names
(`megatron.adapter_shards.adapter_params`: `chunk{c}.` + the wrapper-stripped name, e.g.
`chunk0.decoder.layers.0.self_attention.linear_qkv.adapter.adapters.1.linear_in.weight`) selects
the slot's adapter weights; the caller gives it (Miles names a slot's weights with `.adapter.` and
the slot index). `optimizer_children` (leaf indices, e.g. Miles'
`optimizer.miles_slot_child_indices[slot]`) are the slot's optimizer children, and
`opt_param_scheduler` the scheduler that drives only those children (Miles v1:
`optimizer.miles_slot_schedulers[slot]`). The empty-shard guard: the filter must match at least one
adapter parameter, and with children given it must match exactly the parameters those children
step; otherwise the save (or load) fails on every rank before anything is written (or changed).

Which slot is one value, `SlotSpec` (its root, index, adapter filter, optimizer children), and
what a slot save writes another, `SlotSave` (step, keep, PEFT export, reader names, data state):
`save_slot`, `load_slot` and `retire_slot` take them; `save_slot_checkpoint` and
`load_slot_checkpoint` take the same as keywords.

- `save_slot_checkpoint`: adapter shards (per TP/PP and per PP/EP/ETP coordinate), the slot's
  children's fp32 masters, every moment, steps and param groups, and its scheduler, as one new
  generation of the slot root; optional PEFT export (`peft=`), run after the slot's files are
  staged, into the generation's `peft/` or (`peft_prefix=""`) its top, Miles v1's stock names.
- `load_slot_checkpoint`: the newest intact generation (agreed by every rank) or a named one;
  restores exactly that slot, never touching a co-tenant's adapter, masters or moments; with
  `rename_slot` (`rename_by_pattern`) a generation saved from another slot index resumes into
  this one (`remap`).
- `latest_slot_step`: the step of the generation a load would choose (agreed), or None.
- `retire_slot(model, args, SlotSpec, SlotSave, ...)`: the final save of a leaving slot (the same
  step saved twice replaces it atomically), then the slot's optimizer state reset, co-tenants untouched.
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
