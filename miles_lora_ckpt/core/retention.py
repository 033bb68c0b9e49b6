"""Retention: keep the newest N content-verified generations, and never lose the last good one.

`plan_prune` decides, in this order:

1. Generations are walked newest first and content-verified, as a loader would, until `keep`
   intact ones are found: those are kept. A damaged generation never counts among them.
2. If no generation passes, none is removed.
3. The tracker's generation is kept, and so are damaged generations newer than the oldest kept.
   Older generations are removed unread. One whose manifest cannot be read has no known place in
   the order, so it is reported (`PrunePlan.unordered`) and never removed.
4. Staging directories are left alone while another process holds a live writer lease. The holder
   removes all but its own attempts in flight; without a lease, those older than
   `staging_min_age_s` go.
5. `.deleting-*` leftovers of an interrupted removal are finished.
6. Generation links (such as `latest`) to a generation being removed, or to none, go first, so no
   reader follows a link into a half-removed directory.

Removal first renames an entry to `.deleting-<name>`, taking it out of every reader's view, and
never follows a link. A failure on one entry is reported and the others go on. Each save reclaims
crashed attempts' staging directories (`reclaim_staging`). See docs/cli.md, "What `gc` and
retention never remove".
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import attempts, lease, signing
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.layout import (
    DELETING_PREFIX,
    MANIFEST,
    Manifest,
    is_staging_dir_name,
    parse_generation_dir_name,
)
from miles_lora_ckpt.core.verify import RootEntry, is_unordered, reason, verify_generation, view_root

__all__ = [
    "PrunePlan",
    "PruneReport",
    "generation_links",
    "plan_prune",
    "prune",
    "prune_quietly",
    "reclaim_staging",
]

log = logging.getLogger(__name__)


@dataclass
class PrunePlan:
    """What a prune keeps and removes, and why some things were left alone."""

    remove: list[Path]
    kept: list[str]  # the content-verified generations counted among the N kept, newest first
    notes: list[str] = field(default_factory=list)
    # Generation directories whose manifest cannot be read: order unknown, never removed.
    unordered: list[str] = field(default_factory=list)


@dataclass
class PruneReport(PrunePlan):
    """A plan as carried out: what was removed, and what failed to be, with the reason."""

    removed: list[Path] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)


def plan_prune(
    root: Path,
    *,
    keep: int,
    staging_min_age_s: float = 0.0,
    key: Any = signing.FROM_SETTINGS,
    trusted: tuple[str, ...] = (),
    as_holder: bool = False,
) -> PrunePlan:
    """The plan of a prune of `root` keeping `keep` generations (the module docstring's rules).

    It removes nothing. `as_holder` means this process's save calls it, holding the root's writer
    lease (checked). `trusted` names generations counted as verified without reading them; `key` is
    the signing key. Raises ValueError when `keep` is below 1.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    root, key = Path(root), signing.resolve(key)
    view = view_root(root, key=key)
    generations = view.generations()
    kept: list[RootEntry] = []
    for entry in generations:
        if len(kept) == keep:
            break
        if entry.state != "damaged" and _content_ok(root / entry.name, entry, key, trusted):
            kept.append(entry)
    unordered = [e.name for e in generations if is_unordered(root, e)]
    plan = PrunePlan([], [e.name for e in kept], list(view.warnings), unordered)
    if not kept:
        plan.notes.append("no generation passed content verification: no generation removed")
    else:
        oldest_kept = kept[-1].order
        spared = {e.name for e in kept} | {view.tracker.generation_dir if view.tracker else None} | set(unordered)
        plan.remove += [root / e.name for e in generations if e.name not in spared and e.order < oldest_kept]
    doomed = {path.name for path in plan.remove}
    present = {e.name for e in generations}
    plan.remove[:0] = [
        root / link for link, target in generation_links(root).items() if target in doomed or target not in present
    ]
    staging = [e for e in view.entries if e.state == "staging"]
    plan.remove += _doomed_staging(root, staging, staging_min_age_s, plan, as_holder)
    plan.remove += [root / e.name for e in view.entries if e.state == "deleting"]
    return plan


def prune(
    root: Path,
    *,
    keep: int,
    staging_min_age_s: float = 0.0,
    dry_run: bool = False,
    key: Any = signing.FROM_SETTINGS,
    trusted: tuple[str, ...] = (),
    as_holder: bool = False,
) -> PruneReport:
    """Remove what `plan_prune` names (nothing with `dry_run`); returns the `PruneReport`.

    Raises as `plan_prune` does; a failure to remove one entry is reported, not raised.
    """
    plan = plan_prune(
        root, keep=keep, staging_min_age_s=staging_min_age_s, key=key, trusted=trusted, as_holder=as_holder
    )
    report = PruneReport(plan.remove, plan.kept, plan.notes, plan.unordered)
    if not dry_run:
        for path in plan.remove:
            failure = _remove(path)
            if failure is None:
                report.removed.append(path)
                _verified.pop(str(path), None)
            else:
                report.failed.append((path, failure))
    return report


def prune_quietly(root: Path, *, keep: int, trusted: tuple[str, ...] = ()) -> None:
    """`prune` for the end of a save, trusting the generations in `trusted`.

    It runs after the last collective, so it logs instead of raising. A generation this process
    verified is not read again while its files' inode, size and times are unchanged.
    """
    try:
        report = prune(root, keep=keep, trusted=trusted, as_holder=True)
    except Exception as exc:  # noqa: BLE001 - the save is already committed; never fail it here
        if isinstance(exc, (MilesLoraCkptError, OSError)):
            log.warning("retention in %s failed (the new generation is committed): %s", root, exc)
        else:  # a bug: never damage, never silent; the traceback goes to the log
            log.error("retention in %s failed (the new generation is committed): internal error", root, exc_info=exc)
        return
    for path, failure in report.failed:
        log.warning("retention in %s could not remove %s: %s", root, path.name, failure)
    for note in report.notes:
        log.warning("retention in %s: %s", root, note)


# --------------------------------------------------------------------------- decisions


def generation_links(root: Path) -> dict[str, str]:
    """`{link name: generation name}` of every symlink in `root` whose target is a `gen-*` name."""
    links = {}
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(root / name)
        except OSError:  # not a link (or gone)
            continue
        if "/" not in target and parse_generation_dir_name(target) is not None:
            links[name] = target
    return dict(sorted(links.items()))


def _doomed_staging(
    root: Path, entries: list[RootEntry], min_age_s: float, plan: PrunePlan, as_holder: bool
) -> list[Path]:
    if not entries:
        return []
    if as_holder and _still_hold(root):  # ours: live only if one of our attempts is still in flight
        in_flight = attempts.live(root)
        return [root / e.name for e in entries if e.name not in in_flight]
    state = lease.read_state(root)
    if state is not None and state.live:
        plan.notes.append(
            f"{len(entries)} staging director(ies) left alone: the root's writer lease is {state.describe()}"
        )
        return []
    now, doomed = time.time(), []
    for entry in entries:
        try:
            if now - os.lstat(root / entry.name).st_mtime >= min_age_s:
                doomed.append(root / entry.name)
        except FileNotFoundError:
            pass
    return doomed


def reclaim_staging(root: Path) -> list[str]:
    """Remove what crashed save attempts left in `root`; returns the names removed.

    That is every staging directory no attempt of this process owns, and their `.deleting-`
    leftovers. It acts only while this process holds the writer lease, so no other writer's attempt
    can be live. Without the lease it removes nothing; a lost lease raises `lease.LeaseHeld`. A
    failure to remove one entry is logged, never raised.
    """
    root = Path(root)
    if not lease.holds(root):
        return []
    lease.confirm(root)
    in_flight = attempts.live(root)
    removed = []
    for name in sorted(os.listdir(root)):
        leftover = name.startswith(DELETING_PREFIX) and is_staging_dir_name(name[len(DELETING_PREFIX) :])
        if not (is_staging_dir_name(name) and name not in in_flight) and not leftover:
            continue
        failure = _remove(root / name)
        if failure is None:
            removed.append(name)
        else:
            log.warning("save root %s: could not remove %s, left by a crashed save: %s", root, name, failure)
    if removed:
        log.info("save root %s: removed %d staging director(ies) of crashed saves: %s", root, len(removed), removed)
    return removed


def _still_hold(root: Path) -> bool:
    if not lease.holds(root):
        return False
    try:
        lease.confirm(root)
    except (lease.LeaseHeld, OSError):
        return False
    return True


_verified: dict[str, tuple] = {}  # generation path -> signature of its files when verified


def _content_ok(path: Path, entry: RootEntry, key, trusted: tuple[str, ...]) -> bool:
    before = _signature(path, entry.generation.manifest)
    if before is not None and (entry.name in trusted or _verified.get(str(path)) == before):
        _verified[str(path)] = before
        return True
    checked = verify_generation(path, key=key)
    if not checked.intact:
        entry.state, entry.generation = "damaged", checked
        return False
    after = _signature(path, checked.manifest)
    if after is not None and after == before:
        _verified[str(path)] = after
    return True


def _signature(path: Path, manifest: Manifest | None) -> tuple | None:
    """Identity of every file of a generation as the file system reports it (None if unknown)."""
    if manifest is None:
        return None
    try:
        stats = [(rel, os.lstat(path / rel)) for rel in (MANIFEST, *sorted(manifest.files))]
    except OSError:
        return None
    return tuple((rel, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for rel, s in stats)


# --------------------------------------------------------------------------- removal


def _remove(path: Path) -> str | None:
    """Remove one entry of a root; returns why it failed (None: removed, or already gone)."""
    try:
        if not path.name.startswith(DELETING_PREFIX):
            path = _move_out_of_view(path)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)  # unlinks links inside, never follows them
        else:
            os.unlink(path)  # a link, FIFO or file named like a generation: never followed
    except FileNotFoundError:
        return None  # removed by someone else meanwhile
    except OSError as exc:
        return reason(exc)
    return None


def _move_out_of_view(path: Path) -> Path:
    target = path.with_name(f"{DELETING_PREFIX}{path.name}")
    try:
        os.rename(path, target)
    except OSError:
        if not os.path.lexists(target):
            raise
        target = path.with_name(f"{DELETING_PREFIX}{path.name}.{secrets.token_hex(4)}")
        os.rename(path, target)
    return target
