"""Per-slot resume: which generation of a slot root (agreed by every rank), and restoring exactly that slot.

Collective; the single-LoRA loader's phases (`savers.single_lora.load.load_adapter_generation`)
with the slot's adapter filter and children: classify -> agree -> plan -> agree -> open_generation
(resolve, verify, agree) -> preflight (slot checks, coverage) -> agree -> apply -> scatter ->
install -> finish, each agreed; a failure after preflight rolls every rank back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.savers.single_lora.common import LoadResult

AdapterFilter = Callable[[str], bool]


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
) -> LoadResult:
    """Collective. Restore slot `slot` from `slot_root`: its newest intact generation, or `name`.

    - The generation is agreed by every rank (stray, malformed, half-written or damaged entries
      are skipped with a warning, never chosen, never crash the scan). `name` picks a reader link
      of the root (e.g. `step_6`, a Miles v2 checkpoint name) or a `gen-*` directory instead; it
      never falls back.
    - Restores the slot's adapter weights (`adapter_filter`), its children's (`optimizer_children`)
      fp32 masters, every moment, steps and param groups, and `opt_param_scheduler` exactly; no
      other child's masters or moments change, nothing is refreshed from bf16 beyond the slot's
      own children (and those only where no optimizer state was saved, or `load_optim=False`).
    - Refused on every rank before anything changes (IncompatibleCheckpoint inside the
      CheckpointError): a generation of another saver, of another slot index, another
      model-parallel layout (TP/PP/EP/ETP/CP/VPP; DP may change), or one that does not cover every
      parameter of the slot on this rank (the empty-shard guard), or a filter that matches nothing.
    - A missing root, or one with nothing committed yet, loads nothing (`result.loaded` False).
    `result.iteration` is the slot's step.
    """
    raise NotImplementedError


def latest_slot_step(slot_root: str | os.PathLike, *, consensus: Consensus | None = None) -> int | None:
    """Collective. The step of the generation `load_slot_checkpoint` would choose (newest intact,
    agreed by every rank, fully verified), or None when the root is missing or holds none."""
    raise NotImplementedError
