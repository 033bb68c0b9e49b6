"""Retention: keep the newest N committed generations, remove abandoned staging directories.

Deletion first renames a directory to `.deleting-<name>` (one atomic step that takes it out of
every reader's view), then removes it; a crash in between leaves only a `.deleting-*` leftover that
the next prune finishes. What the tracker names is never removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from miles_lora_ckpt.core.verify import read_tracker, scan_root

log = logging.getLogger(__name__)


def plan_prune(root: Path, *, keep: int, staging_min_age_s: float = 0.0) -> list[Path]:
    """The directories a prune would remove.

    Keeps the newest `keep` intact generations (by commit time), the tracker's generation, and
    every damaged generation newer than the oldest one kept (left for an operator to look at). Staging
    directories younger than `staging_min_age_s` are kept too (an attempt may be in progress).
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    root = Path(root)
    entries = scan_root(root)
    intact = [e for e in entries if e.state == "committed"]
    kept = {e.name for e in intact[:keep]} | {read_tracker(root)}
    oldest_kept = min(e.created_unix_ns for e in intact[:keep]) if intact else None
    doomed = []
    now = time.time()
    for entry in entries:
        path = root / entry.name
        if entry.state in ("staging", "deleting"):
            if entry.state == "deleting" or now - path.stat().st_mtime >= staging_min_age_s:
                doomed.append(path)
        elif entry.name not in kept and oldest_kept is not None and entry.created_unix_ns < oldest_kept:
            doomed.append(path)
    return doomed


def prune(root: Path, *, keep: int, staging_min_age_s: float = 0.0, dry_run: bool = False) -> list[Path]:
    """Remove what `plan_prune` names (nothing with `dry_run`); returns those paths."""
    doomed = plan_prune(root, keep=keep, staging_min_age_s=staging_min_age_s)
    if not dry_run:
        for path in doomed:
            _remove(path)
    return doomed


def prune_quietly(root: Path, *, keep: int) -> None:
    """`prune` for the end of a save: runs after the last collective, so it logs instead of raising."""
    try:
        prune(root, keep=keep)
    except Exception as exc:  # noqa: BLE001 - the save is already committed; never fail it here
        log.warning("retention in %s failed (the new generation is committed): %s", root, exc)


def _remove(path: Path) -> None:
    if not path.name.startswith(".deleting-"):
        moved = path.with_name(f".deleting-{path.name}")
        os.rename(path, moved)
        path = moved
    shutil.rmtree(path)
