"""Slot roots and the names in them: the saver name, Miles' reader names, and how they are checked.

A slot root's layout is drawn in docs/multi-lora.md, "Slot roots". Attempt directories start
with `.staging-` and generations with `gen-`. Neither starts with `step_` nor parses as
`step_<int>` (Miles v1's scan) or `_version_...` (Miles v2's checkpoint_io). So Miles' own readers
never take an attempt for a checkpoint.

Reader names are given per save (`reader_names=`). Miles v1 readers look for `step_N`
(`v1_step_name(N)`); Miles v2 readers look for the name the caller gave `save_slot`. The same
step saved twice (a periodic save, then the retire save) publishes a second generation and swaps
the link, so there is never a moment without one.
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

__all__ = ["SLOT_SAVER", "AdapterFilter", "check_reader_name", "reader_links", "v1_step_name"]


def v1_step_name(step: int) -> str:
    """`step_{step}`: the name Miles v1's `find_latest_checkpoint` looks for.

    Miles v1's `save_due_adapter_checkpoints` writes the same name. Raises ValueError for a `step`
    that is not a non-negative int.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a slot step is a non-negative int, got {step!r}")
    return f"step_{step}"


def check_reader_name(name: str) -> str:
    """`name` itself, if it can be a reader link in a slot root; ValueError otherwise.

    A reader name is one plain path component and not one of the protocol's own names.
    """
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
    """`{link name: generation directory name}` of every reader link in `root`.

    A reader link is a relative symlink naming one `gen-*` directory; dangling ones are included.
    `latest` is not a reader link.
    """
    return {name: target for name, target in generation_links(Path(root)).items() if name != LATEST}
