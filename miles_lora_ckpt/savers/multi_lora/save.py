"""Per-slot save: one slot's adapter shards, optimizer children and scheduler as one generation.

Collective. It runs the single-LoRA saver's phases (`save_adapter_generation`) with the slot's
adapter filter and children, then the protocol's, whose publish also swaps the reader links::

    plan -> agree -> layout (empty-shard guard) -> agree -> [PEFT: plan, bind] -> optimizer, local
    -> agree -> protocol.save_generation (prepare -> write: adapter shards, optimizer, training
    state -> [produce: the collective PEFT export -> write-produced: its two files] -> commit ->
    publish + reader links, each agreed)

With `peft`, the export runs after the slot's shards are staged, the order of a Miles v1 slot
save. An export that fails leaves nothing but its own attempt's staging directory. That is never
read, and is removed by its coordinator or, if that was killed, by the next save into the root.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.savers.multi_lora.naming import SLOT_SAVER, AdapterFilter
from miles_lora_ckpt.savers.multi_lora.slot import SlotSave, SlotSpec
from miles_lora_ckpt.savers.options import SaveOptions
from miles_lora_ckpt.savers.peft_export import GENERATION_SUBDIR, PeftExport
from miles_lora_ckpt.savers.single_lora.common import SaverSpec
from miles_lora_ckpt.savers.single_lora.save import save_adapter_generation

__all__ = ["save_slot", "save_slot_checkpoint"]


def save_slot_checkpoint(
    model,
    args,
    slot_root: str | os.PathLike,
    *,
    slot: int,
    step: int,
    adapter_filter: AdapterFilter,
    optimizer=None,
    opt_param_scheduler=None,
    optimizer_children: Iterable[int] | None = None,
    consensus: Consensus | None = None,
    keep: int | None = None,
    peft: PeftExport | None = None,
    reader_names: Sequence[str] = (),
    peft_prefix: str = GENERATION_SUBDIR,
    data_state: dict | None = None,
) -> str:
    """Collective. Save slot `slot` at its step `step` as a new generation of `slot_root`.

    Returns the committed generation directory. A failure raises the same CheckpointError on every
    rank. The keywords make a `SlotSpec` (`slot_root`, `slot`, `adapter_filter`,
    `optimizer_children`) and a `SlotSave` (the rest but the live objects); see `save_slot`.

    - `adapter_filter(name)` picks the slot's adapter weights among the chunk-qualified adapter
      parameter names. `optimizer_children` are the slot's children as leaf indices, e.g.
      `optimizer.miles_slot_child_indices[slot]`. Their fp32 masters, every moment, steps and
      param groups are saved; no other child is read.
    - `opt_param_scheduler` is the slot's own scheduler, or None. With `optimizer=None` or
      `args.no_save_optim`, only the adapter and the step are saved.
    - Empty-shard guard: the filter must match at least one adapter parameter on some rank. With
      children, it must match exactly the parameters those children step. Otherwise every rank
      raises before anything is written.
    - `reader_names` (e.g. `[v1_step_name(step)]`) become relative symlinks to the new generation
      at its publish, each swapped atomically. An existing entry of that name that is not a
      symlink is refused at prepare.
    - `peft`: also export the slot as an HF PEFT adapter, after the slot's files are staged. If
      the export fails, the save fails. docs/multi-lora.md, "PEFT files per slot", shows the
      `PeftExport` a slot needs.
    - `peft_prefix`: `"peft/"` (default), or `""` for the two PEFT files at the generation's top.
      Those are Miles v1's stock names, so `PeftModel.from_pretrained(<root>/step_N)` loads the
      slot.
    - `data_state`: rank 0's data state of the adapter at this step (`rollout_id` = `step`). It is
      committed as `rollout_data_state.json` in the same generation.
    - `keep`: afterwards prune the root to the newest `keep` generations, reader links included.

    The manifest records `slot`: index, step and the saved parameter names per file. Saving the
    same step again publishes a new generation and swaps the links, never leaving a moment
    without one.
    """
    slot_spec = SlotSpec.of(slot_root, slot, adapter_filter, optimizer_children)
    save = SlotSave(
        step=step, keep=keep, peft=peft, peft_prefix=peft_prefix, reader_names=reader_names, data_state=data_state
    )
    return save_slot(
        model, args, slot_spec, save, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler, consensus=consensus
    )


def save_slot(
    model,
    args,
    slot: SlotSpec,
    save: SlotSave,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    consensus: Consensus | None = None,
) -> str:
    """Collective. `save_slot_checkpoint` with its slot and its save as one value each.

    Returns the committed generation directory. Bad values in either (`SlotSpec.checked`,
    `SlotSave.checked`), or ranks that disagree on them, raise the same CheckpointError on every
    rank before anything is written. A later failure raises it too.
    """
    consensus = consensus or Consensus.default()
    # arguments: checked on every rank, and every rank must save the same slot, step and names
    checked = attempt(lambda: [slot.checked(), *save.checked()])
    index, step, names = consensus.agree_same("arguments", checked)

    def slot_metadata(layout) -> dict:
        return {"slot": {"index": index, "step": step, "params": sorted(layout.adapter_names or ())}}

    options = SaveOptions(
        iteration=step,
        keep=save.keep,
        optimizer_children=slot.optimizer_children,
        peft=save.peft,
        data_state=save.data_state,
    )
    spec = SaverSpec(
        saver=SLOT_SAVER,
        adapter_filter=slot.adapter_filter,
        links=names,
        extra_metadata=slot_metadata,
        export_after_write=True,
        peft_prefix=save.peft_prefix,
        legacy=False,
    )
    return save_adapter_generation(
        model,
        args,
        slot.root,
        options,
        optimizer=optimizer,
        opt_param_scheduler=opt_param_scheduler,
        consensus=consensus,
        spec=spec,
    )
