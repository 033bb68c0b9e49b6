"""Per-slot resume: the generation every rank agrees on, and restoring exactly that slot.

Collective. It runs the single-LoRA loader's phases (`load_adapter_generation`) with the slot's
adapter filter and children::

    classify -> agree -> plan -> agree -> open_generation (resolve, verify, agree) -> preflight
    (slot checks, coverage) -> agree -> apply -> scatter -> install -> finish, each agreed

A failure after preflight rolls every rank back.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from miles_lora_ckpt.core import signing
from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.core.errors import GenerationDamaged, IncompatibleCheckpoint, NotACheckpoint, NothingCommitted
from miles_lora_ckpt.core.layout import parse_generation_dir_name
from miles_lora_ckpt.core.protocol import open_generation
from miles_lora_ckpt.core.verify import check_structure, committed_candidates, find_candidates
from miles_lora_ckpt.megatron.topology import current_topology
from miles_lora_ckpt.savers.multi_lora.naming import SLOT_SAVER, AdapterFilter, check_reader_name, reader_links
from miles_lora_ckpt.savers.multi_lora.remap import SlotRemap, SlotRenamer, model_view, optimizer_view
from miles_lora_ckpt.savers.multi_lora.slot import SlotSpec
from miles_lora_ckpt.savers.options import LoadOptions
from miles_lora_ckpt.savers.single_lora.common import LoadResult, SaverSpec, chunk_count, saved_metadata
from miles_lora_ckpt.savers.single_lora.load import load_adapter_generation

__all__ = ["latest_slot_step", "load_slot", "load_slot_checkpoint"]


def load_slot_checkpoint(
    model,
    slot_root: str | os.PathLike,
    *,
    slot: int,
    adapter_filter: AdapterFilter,
    optimizer=None,
    opt_param_scheduler=None,
    optimizer_children: Iterable[int] | None = None,
    consensus: Consensus | None = None,
    name: str | None = None,
    load_optim: bool = True,
    rename_slot: SlotRenamer | None = None,
) -> LoadResult:
    """Collective. Restore slot `slot` from `slot_root`: its newest intact generation, or `name`.

    Returns the `LoadResult`, whose `iteration` is the slot's step. Raises the same CheckpointError
    on every rank. The keywords `slot_root`, `slot`, `adapter_filter` and `optimizer_children`
    make a `SlotSpec` (see `load_slot`).

    - Which generation: every rank agrees on it. Stray, malformed, half-written or damaged entries
      are skipped with a warning, never chosen. `name` picks a reader link of the root (e.g.
      `step_6`) or a `gen-*` directory instead, and never falls back.
    - What is restored, exactly: the adapter weights `adapter_filter` picks, and the fp32
      masters, every moment, steps and param groups of `optimizer_children`, and
      `opt_param_scheduler`. No other child changes. Only the slot's own children are refreshed
      from bf16, where no optimizer state was saved or with `load_optim=False`.
    - What is refused, on every rank before anything changes (IncompatibleCheckpoint inside the
      CheckpointError): a generation of another saver or slot index, or one saved at a
      model-parallel layout that cannot reshard (see `megatron.reshard`; DP may change). So is a
      generation that does not cover every parameter of the slot on this rank, and a filter that
      matches nothing (the empty-shard guard).
    - Another slot index: with `rename_slot` (a `remap.SlotRenamer`), a generation saved from slot
      `i` loads into slot `slot`, as `remap` describes, at its saved model-parallel layout only
      (DP may change). Shapes, parameter sets, child count, classes, families and state keys must
      correspond one-to-one, or the load is refused. Every other slot stays bit-identical.
      Without `rename_slot`, another slot index is refused.
    - The saved index is read from the newest structurally intact generation (or `name`). If the
      loader then falls back past a damaged one to yet another slot index, the load is refused;
      load that generation by `name`.
    - A missing root, or one with nothing committed yet, loads nothing (`result.loaded` False).
    """
    slot_spec = SlotSpec.of(slot_root, slot, adapter_filter, optimizer_children)
    return load_slot(
        model,
        slot_spec,
        optimizer=optimizer,
        opt_param_scheduler=opt_param_scheduler,
        consensus=consensus,
        name=name,
        load_optim=load_optim,
        rename_slot=rename_slot,
    )


def load_slot(
    model,
    slot: SlotSpec,
    *,
    optimizer=None,
    opt_param_scheduler=None,
    consensus: Consensus | None = None,
    name: str | None = None,
    load_optim: bool = True,
    rename_slot: SlotRenamer | None = None,
) -> LoadResult:
    """Collective. `load_slot_checkpoint` with its slot as one value.

    Restores `slot` from its root's newest intact generation, or the one `name` picks;
    `load_optim` and `rename_slot` are as there. Returns the `LoadResult`, whose `iteration` is the
    slot's step. Raises the same CheckpointError on every rank; a bad `slot` (`SlotSpec.checked`)
    raises it before anything is read.
    """
    consensus = consensus or Consensus.default()
    # arguments: checked on every rank, and every rank must load the same slot
    index = consensus.agree_same("arguments", attempt(slot.checked))
    slot_root, adapter_filter, optimizer_children = slot.root, slot.adapter_filter, slot.optimizer_children
    path = Path(slot_root)
    if name is not None:  # the coordinator reads the link once; every rank opens what it named
        consensus.agree_same("classify", Outcome.success([str(slot_root), name]))
        named = attempt(_named, path, name) if consensus.rank == 0 else Outcome.success()
        path = path / consensus.agree("classify", named)[0]

    # remap: the coordinator reads which slot (and children) the generation to load was saved from
    consensus.agree_same("remap", Outcome.success(str(path)))
    probed = attempt(_saved_slot, path) if consensus.rank == 0 else Outcome.success()
    saved_slot, saved_children = consensus.agree("remap", probed)[0] or (index, None)
    remap = None
    if saved_slot != index and rename_slot is not None:
        remap = SlotRemap(saved_slot, index, rename_slot)
        views = attempt(_views, remap, model, optimizer, saved_children, optimizer_children)
        consensus.agree("remap", views.map(lambda _: None))
        model, optimizer, optimizer_children = views.value
        adapter_filter = remap.view_filter(adapter_filter)
    expected = saved_slot if remap is not None else index

    def same_slot(manifest) -> None:
        saved = saved_metadata(manifest, "slot", "index")
        if saved != expected:
            hint = (
                f"the newest generation holds slot {expected}: load this one by name"
                if remap is not None
                else "an adapter resumes into another slot index only with rename_slot"
            )
            raise IncompatibleCheckpoint(
                f"generation {manifest.generation} holds slot {saved}, not slot {index} ({hint})"
            )
        if remap is not None:  # a renamer names this layout's parameters: no resharding through it
            changes = manifest.topology.model_parallel_differences(current_topology(chunk_count(model)))
            if changes:
                raise IncompatibleCheckpoint(
                    f"generation {manifest.generation} holds slot {saved}, saved at another model-parallel layout "
                    f"(this run differs in {', '.join(changes)}): a slot resumes into another slot index "
                    "(rename_slot) at its saved layout only"
                )

    spec = SaverSpec(saver=SLOT_SAVER, adapter_filter=adapter_filter, check_manifest=same_slot, legacy=False)
    options = LoadOptions(load_optim=load_optim, optimizer_children=optimizer_children)
    return load_adapter_generation(
        model,
        path,
        options,
        optimizer=optimizer,
        opt_param_scheduler=opt_param_scheduler,
        consensus=consensus,
        spec=spec,
    )


def _saved_slot(path: Path) -> list | None:
    """`[slot index, optimizer selection]` of the generation a load of `path` tries first, or None.

    That is the newest structurally intact one; the load verifies its files. None when there is
    none, and the load then says why.
    """
    key = signing.configured_key()
    try:
        candidates = find_candidates(path, key=key).paths
    except (NotACheckpoint, NothingCommitted, GenerationDamaged):
        return None
    for candidate in candidates:
        generation = check_structure(candidate, key=key)
        if generation.intact:
            metadata = generation.manifest.metadata
            index = (metadata.get("slot") or {}).get("index")
            if not isinstance(index, int) or isinstance(index, bool):
                return None  # not a slot generation: the load refuses it
            return [index, metadata.get("optimizer_selection")]
    return None


def _views(remap: SlotRemap, model, optimizer, saved_children, optimizer_children):
    """The loader's model, optimizer and children for `remap` (see `remap`)."""
    viewed_model = model_view(model, remap)
    if optimizer is None or optimizer_children is None:
        return viewed_model, optimizer, optimizer_children
    viewed, children = optimizer_view(optimizer, saved_children, list(optimizer_children))
    return viewed_model, viewed, children


def _named(root: Path, name: str) -> str:
    """The generation directory `name` stands for: itself (`gen-*`) or a reader link's target."""
    if parse_generation_dir_name(name) is not None:
        return name
    check_reader_name(name)
    target = reader_links(root).get(name)
    if target is None:
        raise FileNotFoundError(f"{root / name} is not a reader link of this slot root (no such link to a generation)")
    return target


def latest_slot_step(slot_root: str | os.PathLike, *, consensus: Consensus | None = None) -> int | None:
    """Collective. The step of the generation `load_slot_checkpoint` would choose, or None.

    That generation is the newest intact one, agreed by every rank and fully verified. None when
    the root is missing or holds none. Raises the same CheckpointError on every rank, e.g. for a
    generation of another saver.
    """
    consensus = consensus or Consensus.default()
    consensus.agree_same("classify", Outcome.success(str(slot_root)))
    local = attempt(_has_generations, Path(slot_root)) if consensus.rank == 0 else Outcome.success()
    if not consensus.agree("classify", local)[0]:
        return None

    def nothing_to_read(manifest) -> list[str]:
        if manifest.saver != SLOT_SAVER:
            raise IncompatibleCheckpoint(f"generation {manifest.generation} was written by saver {manifest.saver!r}")
        return []

    return open_generation(consensus, slot_root, nothing_to_read).manifest.iteration


def _has_generations(root: Path) -> bool:
    try:
        committed_candidates(root)
    except (NothingCommitted, NotACheckpoint):
        if root.exists() and not root.is_dir():
            raise
        return False
    return True
