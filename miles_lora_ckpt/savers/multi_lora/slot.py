"""A slot, and what one slot save writes, as one value each: `SlotSpec`, `SlotSave`.

`save_slot`, `load_slot` and `retire_slot` take a `SlotSpec`: which slot it is. Saving, they also
take a `SlotSave`: the step and what the generation holds besides the slot's state. The keyword
functions `save_slot_checkpoint` and `load_slot_checkpoint` build both from their keywords. Their
checks (`checked`) run inside the collective call, so a bad value raises the same CheckpointError
on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_lora_ckpt.savers.multi_lora.naming import AdapterFilter, check_reader_name
from miles_lora_ckpt.savers.options import children_tuple
from miles_lora_ckpt.savers.peft_export import GENERATION_SUBDIR

if TYPE_CHECKING:
    from miles_lora_ckpt.savers.peft_export import PeftExport

PEFT_PREFIXES = (GENERATION_SUBDIR, "")  # where a slot generation holds its PEFT export: peft/, or its top

__all__ = ["SlotSave", "SlotSpec"]


@dataclass(frozen=True)
class SlotSpec:
    """One adapter slot.

    - `root`: its slot root.
    - `index`: the slot index, e.g. Miles' `adapter.slot`.
    - `adapter_filter(name)`: picks the slot's adapter weights among the chunk-qualified,
      wrapper-stripped adapter parameter names.
    - `optimizer_children`: the slot's optimizer children as sorted leaf indices, e.g.
      `optimizer.miles_slot_child_indices[index]`; None: no optimizer.
    """

    root: Path
    index: int
    adapter_filter: AdapterFilter
    optimizer_children: tuple[int, ...] | None = None

    @classmethod
    def of(
        cls,
        root: str | os.PathLike,
        index: int,
        adapter_filter: AdapterFilter,
        optimizer_children: Iterable[int] | None = None,
    ) -> SlotSpec:
        """A spec from plain values (a path, any iterable of children)."""
        return cls(Path(root), index, adapter_filter, children_tuple(optimizer_children))

    def checked(self) -> int:
        """The slot index, checked together with the filter.

        Raises ValueError for a negative or non-int index, TypeError for a filter that is not
        callable.
        """
        if not callable(self.adapter_filter):
            raise TypeError("adapter_filter must be a callable name -> bool that picks the slot's adapter weights")
        index = self.index
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"slot must be a non-negative int, got {index!r}")
        return index


@dataclass(frozen=True)
class SlotSave:
    """What one slot save writes besides the slot's state.

    - `step`: the slot's step, which is the generation's iteration.
    - `keep`: afterwards keep the newest `keep` generations of the root (None: all).
    - `peft`: also export the slot as an HF PEFT adapter.
    - `peft_prefix`: `"peft/"`, or `""` for the PEFT files at the generation's top (Miles v1's
      names).
    - `reader_names`: links the publish points at the generation (e.g. `step_6`).
    - `data_state`: rank 0's data state of the adapter at this step.
    """

    step: int
    keep: int | None = None
    peft: PeftExport | None = None
    peft_prefix: str = GENERATION_SUBDIR
    reader_names: Sequence[str] = ()
    data_state: dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "reader_names", tuple(self.reader_names))

    def checked(self) -> list:
        """`[step, reader names]`, checked.

        Raises ValueError for a negative or non-int step, a reader name that cannot be one, or a
        `peft_prefix` other than those two.
        """
        if self.peft_prefix not in PEFT_PREFIXES:
            raise ValueError(f"peft_prefix must be one of {PEFT_PREFIXES}, got {self.peft_prefix!r}")
        step = self.step
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int (the slot's optimizer-step count), got {step!r}")
        return [step, [check_reader_name(n) for n in self.reader_names]]
