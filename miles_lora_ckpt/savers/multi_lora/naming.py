"""Slot roots and the names in them: the saver name, Miles' reader names, and how they are checked.

A slot root (one per adapter, e.g. Miles v1's `{adapter.config.save}/checkpoints`) holds::

    <slot root>/
      latest_generation.json               tracker (names the newest committed generation)
      .writer-lease.json                   the root's writer lease
      gen-000000006-3f2a9c1e0b7d4e55/      a committed slot generation: iteration = the slot's step
        manifest.json                      saver "multi-lora-slot"; metadata "slot": index, step, params
        training_state.json                step, the slot's scheduler, its children's param groups/steps
        adapter/dense_tp000_pp000.safetensors        the slot's dense adapter weights per (TP, PP)
        adapter/expert_pp000_ep000_etp000.safetensors  its expert adapter weights per (PP, EP, ETP)
        optimizer/child<i>_...safetensors  fp32 masters + every moment of the slot's children
        peft/                              optional HF PEFT adapter directory (`peft=`), or, with
        adapter_model.safetensors          `peft_prefix=""` (what the Miles bindings do), the two
        adapter_config.json                PEFT files at the top: Miles v1's stock names in step_N
      step_6 -> gen-000000006-3f2a...      reader name: a relative symlink, replaced atomically
      .staging-7c0d1e2f3a4b5c6d/           an attempt (unique id chosen on rank 0, broadcast)

Attempt directories start with `.staging-`, generations with `gen-`: neither starts with `step_`
nor parses as `step_<int>` (Miles v1's scan) or `_version_...` (Miles v2's checkpoint_io), so
Miles' own readers never take an attempt for a checkpoint. Reader names are given per save
(`reader_names=`): Miles v1 readers look for `step_N` (`v1_step_name(N)`), Miles v2 readers for
the name the caller gave `save_slot`. The same step saved twice (a periodic save, then the retire
save) publishes a second generation and swaps the link: there is never a moment without one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from miles_lora_ckpt.core.layout import (
    DELETING_PREFIX,
    GENERATION_PREFIX,
    LATEST,
    LEASE,
    MANIFEST,
    STAGING_PREFIX,
    TRACKER,
    parse_generation_dir_name,
)
from miles_lora_ckpt.core.retention import generation_links

# picks a slot's adapter weights among the adapter parameter names (see `save_slot_checkpoint`)
AdapterFilter = Callable[[str], bool]

SLOT_SAVER = "multi-lora-slot"
_READER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,127}\Z", re.ASCII)
_RESERVED = (TRACKER, LEASE, MANIFEST, LATEST)


def v1_step_name(step: int) -> str:
    """The name Miles v1's `find_latest_checkpoint` and `save_due_adapter_checkpoints` look for."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a slot step is a non-negative int, got {step!r}")
    return f"step_{step}"


def check_reader_name(name: str) -> str:
    """`name` if it can be a reader link in a slot root (one plain path component, not one of the
    protocol's own names); ValueError otherwise."""
    if not isinstance(name, str) or not _READER_NAME.match(name):
        raise ValueError(f"reader name {name!r} must be one path component of [A-Za-z0-9_.=+-] (at most 128)")
    if (
        name in _RESERVED
        or name.startswith((GENERATION_PREFIX, STAGING_PREFIX, DELETING_PREFIX, "."))
        or parse_generation_dir_name(name) is not None
    ):
        raise ValueError(f"reader name {name!r} is one of the protocol's own names")
    return name


def reader_links(root: str | os.PathLike) -> dict[str, str]:
    """`{link name: generation directory name}` of every reader link in `root` (relative symlinks
    naming one `gen-*` directory; dangling ones included; `latest` is not a reader link)."""
    return {name: target for name, target in generation_links(Path(root)).items() if name != LATEST}
