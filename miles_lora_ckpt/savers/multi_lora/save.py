"""Per-slot save: one slot's adapter shards, optimizer children and scheduler as a generation of its root.

Collective; the single-LoRA saver's phases (`savers.single_lora.save.save_adapter_generation`) with
the slot's adapter filter and children, then the protocol's, whose publish also swaps the reader
links::

    plan -> agree -> layout (empty-shard guard) -> agree -> [PEFT: plan, bind] -> optimizer, local
    -> agree -> protocol.save_generation (prepare -> write: adapter shards, optimizer, training
    state -> [produce: the collective PEFT export -> write-produced: its two files] -> commit ->
    publish + reader links, each agreed)

With `peft`, the export runs after the slot's shards are staged, as Miles v1 orders a slot save
(shards, then Bridge's export, then the PEFT files): an export that fails leaves nothing but its
own attempt's staging directory (unique per attempt, never read, removed by its coordinator, or,
when the coordinator was killed, by the next save into the slot root).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.savers.multi_lora.naming import SLOT_SAVER, AdapterFilter, check_reader_name
from miles_lora_ckpt.savers.peft_export import GENERATION_SUBDIR, PeftExport
from miles_lora_ckpt.savers.single_lora.save import save_adapter_generation

PEFT_PREFIXES = (GENERATION_SUBDIR, "")  # where a slot generation holds its PEFT export: peft/, or its top


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
    """Collective. Save slot `slot` at its step `step` as a new generation of `slot_root`; returns it.

    - `adapter_filter(name)` picks the slot's adapter weights among the adapter parameters
      (`chunk{c}.`-qualified, wrapper-stripped names); `optimizer_children` (leaf indices, e.g.
      `optimizer.miles_slot_child_indices[slot]`) are the slot's children: their fp32 masters,
      every moment, steps and param groups are saved, no other child is read.
      `opt_param_scheduler` is the slot's own scheduler (or None). With `optimizer=None` or
      `args.no_save_optim` only the adapter and the step are saved.
    - Empty-shard guard: the filter must match at least one adapter parameter on some rank, and,
      with children, exactly the parameters those children step; else every rank raises before
      anything is written.
    - `reader_names`: names (e.g. `[v1_step_name(step)]`, or a Miles v2 checkpoint name) made
      relative symlinks to the new generation by its publish (each swapped atomically; an existing
      entry of that name that is not a symlink is refused at prepare).
    - `peft`: also export the slot as an HF PEFT adapter into the generation's `peft/`
      (`PeftExport(source=BridgeSource(..., model_context=<select the slot>, transform=...), lora=
      LoraSpec(r=<slot rank>, ...))`); if the export fails, the save fails. The export runs after
      the slot's files are staged. `peft_prefix`: `"peft/"` (default) or `""`: the two PEFT files at
      the generation's top, Miles v1's stock names (`step_N/adapter_model.safetensors`,
      `step_N/adapter_config.json`), so `PeftModel.from_pretrained(<root>/step_N)` loads the slot.
    - `data_state`: rank 0's data state of the adapter at this step (`core.data_state.document`,
      `rollout_id` = `step`), committed as `rollout_data_state.json` in the same generation.
    - `keep`: afterwards prune the root to the newest `keep` generations (their reader links too).
    The manifest records `slot` (index, step, the saved parameter names per file). Saving the same
    step again publishes a new generation and swaps the links: never a moment without one.
    """
    consensus = consensus or Consensus.default()
    # arguments: checked on every rank, and every rank must save the same slot, step and names
    checked = attempt(_checked_arguments, slot, step, reader_names, adapter_filter, peft_prefix)
    slot, step, names = consensus.agree_same("arguments", checked)

    def slot_metadata(layout) -> dict:
        return {"slot": {"index": slot, "step": step, "params": sorted(layout.adapter_names or ())}}

    return save_adapter_generation(
        model,
        args,
        slot_root,
        optimizer=optimizer,
        opt_param_scheduler=opt_param_scheduler,
        iteration=step,
        consensus=consensus,
        keep=keep,
        optimizer_children=optimizer_children,
        peft=peft,
        adapter_filter=adapter_filter,
        saver=SLOT_SAVER,
        links=names,
        extra_metadata=slot_metadata,
        export_after_write=True,
        peft_prefix=peft_prefix,
        data_state=data_state,
    )


def _checked_arguments(slot, step, reader_names, adapter_filter, peft_prefix) -> list:
    _required(adapter_filter)
    if peft_prefix not in PEFT_PREFIXES:
        raise ValueError(f"peft_prefix must be one of {PEFT_PREFIXES}, got {peft_prefix!r}")
    return [_slot_index(slot), _slot_step(step), [check_reader_name(n) for n in reader_names]]


def _slot_index(slot) -> int:
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
        raise ValueError(f"slot must be a non-negative int, got {slot!r}")
    return slot


def _slot_step(step) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int (the slot's optimizer-step count), got {step!r}")
    return step


def _required(adapter_filter):
    if not callable(adapter_filter):
        raise TypeError("adapter_filter must be a callable name -> bool that picks the slot's adapter weights")
    return adapter_filter
