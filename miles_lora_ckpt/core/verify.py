"""Strict verification of generations, and resolution of save roots; no megatron, no Miles.

`check_structure` reads only the manifest and `lstat`s the rest. `check_file_content` and
`check_file_ranges` read one listed file, whole or in part, and apply `content_rules`. Every loader
reads its files through them (`protocol.open_generation`), so verify and loaders cannot drift.
`verify_generation` does both for every file.

Damage (`GenerationDamaged`) and the file system's refusal to deliver a listed file (`OSError`) are
problems of the generation, never a crash: resolution moves on to the next candidate (`DAMAGE`).
Any other exception is a bug and propagates, so no loader falls back to older state for it. Roots
are ordered by commit order: format v1 generations by recorded time, then v2 ones by `sequence`.
The tracker is only a hint; each disagreement with it becomes a warning naming both sides.
"""

from __future__ import annotations

import bisect
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from miles_lora_ckpt.core import (
    checked_reads,
    content_rules,
    file_reader,
    host_memory,
    json_files,
    partial_reads,
    regular_files,
    signing,
)
from miles_lora_ckpt.core.errors import GenerationDamaged, NotACheckpoint, NothingCommitted, Problem
from miles_lora_ckpt.core.layout import (
    DELETING_PREFIX,
    LEASE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_TRACKER_BYTES,
    TRACKER,
    Manifest,
    Tracker,
    is_staging_dir_name,
    parse_generation_dir_name,
)

# What a check of a generation may raise for what it finds: the one damage exception, and the
# file system's refusal to deliver a listed file (missing, unreadable, an I/O error). Catch sites
# catch exactly these; every other exception is a bug and fails the load (it never means damage).
DAMAGE = (GenerationDamaged, OSError)

LEGACY_MARKERS = ("adapter_megatron_rank", "training_state_rank", "adapter_megatron_tp")
STRAY_MANIFEST = (
    "a stray manifest.json in a save root, ignored (a generation's manifest belongs inside its gen-* directory)"
)
__all__ = [
    "DAMAGE",
    "Generation",
    "RootEntry",
    "check_file_content",
    "check_file_ranges",
    "check_structure",
    "coalesce_ranges",
    "committed_candidates",
    "damage_problems",
    "find_candidates",
    "find_save_roots",
    "follow_generation_link",
    "is_generation_dir",
    "is_legacy_miles_dir",
    "is_save_root",
    "is_unordered",
    "reason",
    "resolve",
    "scan_root",
    "tracked_generation",
    "verify_generation",
    "view_root",
]

V1_WITH_KEY = (
    "format v1 generations are unsigned, but a signing key is configured: to convert it, load it with no key "
    "configured and save it again with the key (the save writes a signed format v2 generation)"
)


@dataclass
class Generation:
    """A committed-looking generation directory and, when it parsed, its manifest."""

    path: Path
    manifest: Manifest | None
    problems: list[Problem] = field(default_factory=list)
    content_checked: bool = False  # every listed file was read and checked

    @property
    def intact(self) -> bool:
        """Whether the manifest parsed and no problem was found."""
        return self.manifest is not None and not self.problems

    @property
    def order(self) -> tuple:
        """Its sort key in the root's commit order (`commit_order`)."""
        return commit_order(self.manifest, self.path.name)


def commit_order(manifest: Manifest | None, name: str) -> tuple:
    """Sort key of a generation in its root's commit order (larger is newer).

    Format v2: its sequence. Format v1 (no sequence): its recorded commit time, before every v2
    generation. No readable manifest: oldest of all.
    """
    parsed = parse_generation_dir_name(name)
    iteration = parsed[0] if parsed else -1
    if manifest is None:
        return (0, 0, iteration, name)
    if manifest.sequence is not None:
        return (2, manifest.sequence, manifest.iteration, name)
    return (1, manifest.created_unix_ns, manifest.iteration, name)


# --------------------------------------------------------------------------- one generation


def check_structure(gen_dir: Path, *, key: Any = signing.FROM_SETTINGS) -> Generation:
    """The `Generation` at `gen_dir` with its structure's problems; reads only the manifest.

    It checks the manifest (self-digest, fields, signature under `key`), names and listing: every
    listed file a regular file of its size, nothing unlisted. It never raises for anything found on
    disk; a bad key configuration (SigningKeyError), or a bug, does raise.
    """
    gen_dir, key = Path(gen_dir), signing.resolve(key)
    try:
        mode = os.lstat(gen_dir).st_mode
    except OSError as exc:
        return Generation(gen_dir, None, [Problem(".", reason(exc))])
    if not stat.S_ISDIR(mode):
        return Generation(gen_dir, None, [Problem(".", f"generation directory is a {regular_files.file_kind(mode)}")])
    try:
        raw = file_reader.read_file_verified(gen_dir / MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
        manifest = Manifest.from_json_bytes(raw)
    except DAMAGE as exc:
        return Generation(gen_dir, None, [Problem(MANIFEST, reason(exc))])
    problems = []
    # signing.problem never raises on what a signature holds: it says what is wrong.
    if key is not None and manifest.format_version < 2:
        problems.append(Problem(MANIFEST, V1_WITH_KEY))
    elif unsigned := signing.problem(manifest.signature, manifest.sealed_body, key):
        problems.append(Problem(MANIFEST, unsigned))
    problems += _name_problems(gen_dir, manifest)
    try:
        content_rules.check_manifest(manifest)
    except GenerationDamaged as exc:
        problems += damage_problems(exc, MANIFEST)
    try:
        problems += [Problem(rel, why) for rel, why in content_rules.binding_problems(manifest)]
    except GenerationDamaged as exc:
        problems += damage_problems(exc, MANIFEST)
    try:
        problems += _listing_problems(gen_dir, manifest.files)
    except OSError as exc:  # the directory changed under the walk (an entry removed or replaced)
        problems.append(Problem(".", reason(exc)))
    return Generation(gen_dir, manifest, problems)


def check_file_content(
    gen_dir: Path, relpath: str, manifest: Manifest, *, keep: bool = True
) -> checked_reads.CheckedFile:
    """Read listed file `relpath` and apply every content rule (`content_rules`).

    Returns the `CheckedFile`, holding its bytes with `keep=True`. Raises `DAMAGE`
    (GenerationDamaged, OSError) with the reason.
    """
    record = manifest.files[relpath]
    checked = checked_reads.check_file(Path(gen_dir) / relpath, record, keep=keep)
    if checked.entries is not None:
        dtypes = {name: entry[0] for name, entry in checked.entries.items()}
        shapes = {name: entry[1] for name, entry in checked.entries.items()}
        content_rules.check_tensor_file(relpath, manifest, checked.metadata or {}, dtypes, shapes)
    else:
        content_rules.check_json_file(relpath, manifest, checked.value)
    return checked


def check_file_ranges(
    gen_dir: Path, relpath: str, manifest: Manifest, ranges, *, check_only=(), allocate=host_memory.large_buffer
) -> dict:
    """Read some element ranges of listed tensor file `relpath`, with `check_file_content`'s rules.

    Returns `{range: tensor}` for `ranges`; a strided range comes back as its rows, compact. The
    `check_only` ranges are verified in the same pass and not returned. `allocate` is
    `partial_reads.read_ranges`'. Raises `DAMAGE` (GenerationDamaged, OSError) with the reason.

    Overlapping plain ranges of one tensor are merged (`coalesce_ranges`), so each block is read
    and verified once; each range asked is a view of its merged span. Ranges that merely touch
    stay apart, each its own buffer. So a resharding load's moment range can become the state as
    it is, and a master's buffer goes once it is copied.
    """
    record = manifest.files[relpath]
    asked = [(str(item[0]), *(int(v) for v in item[1:])) for item in ranges]
    strided = sorted({item for item in asked if partial_reads.strided_rows(item) is not None})
    plain = [item for item in asked if len(item) == 3]
    # A strided range is read on its own: its rows come back compact (`partial_reads.read_ranges`).
    spans, checked = coalesce_ranges(plain) + strided, coalesce_ranges(item[:3] for item in check_only)
    tensors, metadata = partial_reads.read_ranges(
        Path(gen_dir) / relpath, record, spans, check_only=checked, allocate=allocate
    )
    # read_ranges checked the header against the block index, so its dtypes are the file's.
    dtypes = {name: span[0] for name, span in record.blocks.tensors.items()}
    content_rules.check_tensor_file(relpath, manifest, metadata or {}, dtypes)
    by_name: dict[str, list] = {}
    for (name, first, stop), tensor in sorted(
        ((k, t) for k, t in tensors.items() if len(k) == 3), key=lambda kt: kt[0]
    ):
        by_name.setdefault(name, []).append((first, stop, tensor))
    starts = {name: [span[0] for span in spans] for name, spans in by_name.items()}
    out = {item: tensors[item] for item in strided}
    for name, first, stop in plain:  # the merged span holding it: the last one starting at or before it
        lo, _, tensor = by_name[name][bisect.bisect_right(starts[name], first) - 1]
        out[(name, first, stop)] = tensor[first - lo : stop - lo]
    return out


def coalesce_ranges(ranges) -> list[tuple[str, int, int]]:
    """`(name, first, stop)` element ranges merged where they overlap, per tensor, and sorted.

    Ranges that only touch stay apart (`check_file_ranges` says why).
    """
    merged: list[list] = []
    for name, first, stop in sorted(set(ranges)):
        if merged and merged[-1][0] == name and first < merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], stop)
        else:
            merged.append([name, first, stop])
    return [tuple(span) for span in merged]


def verify_generation(gen_dir: Path, *, key: Any = signing.FROM_SETTINGS) -> Generation:
    """The `Generation` at `gen_dir` with every problem of its structure and files' content.

    It holds one slice of memory at a time and raises as `check_structure` does.
    """
    generation = check_structure(gen_dir, key=key)
    if generation.manifest is None:
        return generation
    listed_problem_files = {p.file for p in generation.problems}
    for relpath in sorted(generation.manifest.files):
        if relpath in listed_problem_files:
            continue
        try:
            check_file_content(gen_dir, relpath, generation.manifest, keep=False)
        except DAMAGE as exc:  # damage of this file; anything else is a bug and propagates
            generation.problems += damage_problems(exc, relpath)
    generation.content_checked = True
    return generation


def _name_problems(gen_dir: Path, manifest: Manifest) -> list[Problem]:
    parsed = parse_generation_dir_name(gen_dir.name)
    if parsed is None:
        return []  # an explicitly named directory may have been copied under another name
    iteration, attempt_id = parsed
    if (iteration, attempt_id) != (manifest.iteration, manifest.generation):
        return [
            Problem(
                MANIFEST,
                f"belongs to generation {manifest.generation} iteration {manifest.iteration}, "
                f"not to this directory (mixed generations)",
            )
        ]
    return []


def _listing_problems(gen_dir: Path, files: dict) -> list[Problem]:
    problems = [Problem(rel, why) for rel in files if (why := _unsafe_relpath(rel))]
    sizes: dict[str, int] = {}
    dirs: set[str] = set()
    odd: dict[str, str] = {}  # relpath -> why it is not a regular file

    def walk_error(exc: OSError) -> None:
        where = Path(exc.filename).relative_to(gen_dir).as_posix() if exc.filename else "."
        problems.append(Problem(where, reason(exc)))

    for dirpath, dirnames, filenames in os.walk(gen_dir, followlinks=False, onerror=walk_error):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(gen_dir).as_posix()
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                odd[rel] = f"symlink to {os.readlink(full)} (not allowed in a generation)"
            elif stat.S_ISREG(st.st_mode):
                sizes[rel] = st.st_size
            elif stat.S_ISDIR(st.st_mode):
                dirs.add(rel)
            else:
                odd[rel] = f"is a {regular_files.file_kind(st.st_mode)} (only regular files belong in a generation)"
    named = {p.file for p in problems}
    for rel, why in sorted(odd.items()):
        problems.append(Problem(rel, why))
    for rel in sorted(set(sizes) - set(files) - {MANIFEST}):
        problems.append(Problem(rel, "not listed in the manifest (extra or renamed file)"))
    for rel, record in sorted(files.items()):
        if rel in named or rel in odd:
            continue
        if rel not in sizes:
            problems.append(Problem(rel, f"listed in the manifest but {'a directory' if rel in dirs else 'missing'}"))
        elif sizes[rel] != record.bytes:
            problems.append(
                Problem(rel, f"size is {sizes[rel]} bytes, manifest says {record.bytes} (truncated or grown)")
            )
    return problems


def _unsafe_relpath(rel: str) -> str | None:
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or rel != pure.as_posix() or rel in ("", ".") or "\0" in rel:
        return "path escapes the generation directory"
    if rel == MANIFEST:
        return "the manifest may not list itself"
    return None


def damage_problems(exc: BaseException, file: str) -> list[Problem]:
    """The problems one `DAMAGE` exception stands for.

    A verdict, `GenerationDamaged(path, problems)`, has its own, each naming its file. One check's
    reason, an OSError or `GenerationDamaged(reason)`, is about `file`, relative to the generation.
    """
    if isinstance(exc, GenerationDamaged) and exc.path:
        return list(exc.problems)
    return [Problem(file, reason(exc))]


def reason(exc: BaseException) -> str:
    """One line for the exception `exc` met while examining a generation."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}"
    if type(exc) is ValueError:
        return str(exc)
    if type(exc) is GenerationDamaged:  # a check's reason, or a verdict's reasons (its files are the context's)
        return "; ".join(p.reason for p in exc.problems) if exc.path else str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- save roots


@dataclass
class RootEntry:
    """One directory of a save root, for `ls` and `gc`."""

    name: str
    state: str  # intact | committed (content not checked) | damaged | staging | deleting
    iteration: int | None
    created_unix_ns: int | None = None
    problems: list[Problem] = field(default_factory=list)
    sequence: int | None = None
    generation: Generation | None = None

    @property
    def order(self) -> tuple:
        """Its sort key in the root's commit order (`commit_order`)."""
        return commit_order(self.generation.manifest if self.generation else None, self.name)

    @property
    def order_known(self) -> bool:
        """False for a generation whose manifest cannot be read.

        Its place in the commit order is unknown: it sorts last, but may be the newest. So nothing
        may remove it.
        """
        return self.generation is not None and self.generation.manifest is not None

    def describe(self) -> str:
        """The entry's name with its place in the commit order, for `ls`."""
        if self.sequence is not None:
            return f"{self.name} (sequence {self.sequence})"
        if self.generation is not None and self.generation.manifest is not None:
            return f"{self.name} (format v1, no sequence)"
        return f"{self.name} (unreadable manifest)"


@dataclass
class RootView:
    """A save root: its entries, its tracker, and each disagreement between them.

    Entries are generations newest first, then staging and deleting ones.
    """

    root: Path
    entries: list[RootEntry]
    tracker: Tracker | None
    warnings: list[str]

    def generations(self) -> list[RootEntry]:
        """The entries that are generations, intact, committed or damaged, newest first."""
        return [e for e in self.entries if e.state in ("intact", "committed", "damaged")]


def view_root(root: Path, *, content: bool = False, key: Any = signing.FROM_SETTINGS) -> RootView:
    """The `RootView` of `root`: every generation, staging and deleting entry, in commit order.

    Generations are checked for structure, and content with `content=True`. The tracker is
    cross-checked. Raises OSError when `root` cannot be listed.
    """
    root, key = Path(root), signing.resolve(key)
    generations, others = [], []
    names = sorted(os.listdir(root))
    for name in names:
        if is_staging_dir_name(name):
            others.append(RootEntry(name, "staging", None))
        elif name.startswith(DELETING_PREFIX):
            others.append(RootEntry(name, "deleting", None))
        elif (parsed := parse_generation_dir_name(name)) is not None:
            gen = verify_generation(root / name, key=key) if content else check_structure(root / name, key=key)
            generations.append(_entry(name, parsed[0], gen, content))
    generations.sort(key=lambda e: e.order, reverse=True)
    tracker, warnings = _cross_check_tracker(root, generations)
    if MANIFEST in names:
        warnings.insert(0, f"{root / MANIFEST}: {STRAY_MANIFEST}")
    warnings += [unordered_warning(e) for e in generations if is_unordered(root, e)]
    return RootView(root, generations + others, tracker, warnings)


def is_unordered(root: Path, entry: RootEntry) -> bool:
    """Whether `entry` of `root` is a real generation directory whose manifest cannot be read.

    Its place in the commit order is unknown, and it may be the newest. So no loader uses it, and
    neither gc nor retention may remove it; it is reported instead.
    """
    if entry.order_known:
        return False
    try:
        return stat.S_ISDIR(os.lstat(Path(root) / entry.name).st_mode)
    except OSError:
        return False


def unordered_warning(entry: RootEntry) -> str:
    """The report of an `is_unordered` generation: its name and why its manifest cannot be read."""
    problems = entry.generation.problems if entry.generation is not None else []
    why = "; ".join(f"{p.file}: {p.reason}" for p in problems[:3]) or "no readable manifest"
    return (
        f"damaged generation {entry.name} cannot be ordered ({why}): its place in the commit order is "
        "unknown, so no loader uses it and gc and retention never remove it (look at it, then remove it "
        "by hand)"
    )


def _entry(name: str, iteration: int, gen: Generation, content: bool) -> RootEntry:
    state = ("intact" if content else "committed") if gen.intact else "damaged"
    m = gen.manifest
    problems = [Problem(f"{name}/{p.file}" if p.file != "." else name, p.reason) for p in gen.problems]
    return RootEntry(
        name,
        state,
        iteration,
        m.created_unix_ns if m else None,
        problems,
        sequence=m.sequence if m else None,
        generation=gen,
    )


def scan_root(root: Path, *, content: bool = False) -> list[RootEntry]:
    """The entries of `view_root` (newest generation first)."""
    return view_root(root, content=content).entries


def tracked_generation(root: Path) -> Path | None:
    """The generation directory `root`'s tracker names, or None (no usable tracker). A hint only:
    what a tracker says is never trusted, a loader reads the listing (`find_candidates`)."""
    tracker, _ = _read_tracker(Path(root))  # a usable tracker names a generation directory (`Tracker`)
    return None if tracker is None else Path(root) / tracker.generation_dir


def _read_tracker(root: Path) -> tuple[Tracker | None, str | None]:
    """The tracker and, when there is a file that cannot be used, why."""
    path = root / TRACKER
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, reason(exc)
    try:
        return Tracker.from_dict(json_files.read_json(path, max_bytes=MAX_TRACKER_BYTES)), None
    except DAMAGE as exc:  # a tracker is a hint: damage makes it unusable
        return None, reason(exc)


def _cross_check_tracker(root: Path, generations: list[RootEntry]) -> tuple[Tracker | None, list[str]]:
    tracker, problem = _read_tracker(root)
    committed = [e for e in generations if e.state != "damaged"]
    newest = committed[0] if committed else None
    newest_text = f"the newest committed generation is {newest.describe()}" if newest else "no generation is committed"
    if problem is not None:
        return None, [f"tracker {TRACKER} is unusable ({problem}); {newest_text}"]
    if tracker is None:
        return None, [f"no tracker ({TRACKER}); {newest_text}"] if newest else []
    said = f"tracker names {tracker.generation_dir}" + (
        f" (sequence {tracker.sequence})" if tracker.sequence is not None else ""
    )
    named = next((e for e in generations if e.name == tracker.generation_dir), None)
    warnings = []
    if named is None:
        warnings.append(f"{said}, which is not in this root; {newest_text}")
    else:
        if tracker.sequence is not None and named.sequence is not None and tracker.sequence != named.sequence:
            warnings.append(f"{said}, but that generation's manifest says sequence {named.sequence}")
        parsed = parse_generation_dir_name(tracker.generation_dir)
        if parsed is not None and parsed != (tracker.iteration, tracker.generation):
            warnings.append(
                f"{said} but says iteration {tracker.iteration} generation {tracker.generation}, "
                "which is not that directory"
            )
        if newest is not None and named is not newest:
            warnings.append(f"{said}, but {newest_text}")
    return tracker, warnings


@dataclass
class Candidates:
    """The generation directories a path stands for, newest first."""

    paths: list[Path]
    is_root: bool
    warnings: list[str] = field(default_factory=list)


def find_candidates(path: Path, *, key: Any = signing.FROM_SETTINGS) -> Candidates:
    """The generation directories to try for `path`: a save root's, newest first, or `path` itself.

    A save root's generation link, such as `latest` or `step_6`, stands for its generation for every
    reader (`follow_generation_link`). Raises NotACheckpoint when `path` holds no generation, a
    legacy Miles directory included. Raises GenerationDamaged for a staging directory, and
    NothingCommitted for a save root with nothing committed yet.
    """
    path = follow_generation_link(Path(path))
    try:
        mode = os.stat(path).st_mode  # the path named by the user may itself be a link
    except FileNotFoundError:
        raise NotACheckpoint(f"{path} does not exist") from None
    except OSError as exc:
        raise NotACheckpoint(f"{path}: {reason(exc)}") from None
    if not stat.S_ISDIR(mode):
        raise NotACheckpoint(f"{path} is a {regular_files.file_kind(mode)}, not a checkpoint directory")
    name = path.name or path.resolve().name
    if is_staging_dir_name(name):
        raise GenerationDamaged(str(path), [Problem(".", "uncommitted staging directory (in progress or abandoned)")])
    if parse_generation_dir_name(name) is not None:
        return Candidates([path], False)
    names = os.listdir(path)
    if _has_root_markers(names):
        view = view_root(path, key=key)
        generations = view.generations()
        if not generations:
            raise NothingCommitted(str(path), [Problem(".", "save root has no committed generation (only staging)")])
        return Candidates([path / e.name for e in generations], True, view.warnings)
    if MANIFEST in names:
        return Candidates([path], False)
    kind = "a legacy Miles adapter directory (no manifest)" if is_legacy_miles_dir(path) else "not a checkpoint"
    raise NotACheckpoint(f"{path} is {kind}")


def follow_generation_link(path: Path) -> Path:
    """The sibling generation a save root's link names, or `path` itself when it is not one.

    `root/latest -> gen-...` gives `root/gen-...`. Only a relative target of one `gen-*` name is
    followed. A link to anything else stays as it is: a symlink in place of a generation is damage.
    """
    path = Path(path)
    try:
        target = os.readlink(path)
    except OSError:  # not a link (or gone): judged as it is
        return path
    if "/" not in target and parse_generation_dir_name(target) is not None:
        return path.parent / target
    return path


def committed_candidates(path: Path) -> tuple[list[Path], bool]:
    """`find_candidates` as `(paths, is_root)`; raises as it does."""
    candidates = find_candidates(path)
    return candidates.paths, candidates.is_root


def _has_root_markers(names: list[str]) -> bool:
    return any(
        n in (TRACKER, LEASE) or parse_generation_dir_name(n) is not None or is_staging_dir_name(n) for n in names
    )


def is_generation_dir(path: Path) -> bool:
    """Whether `path` is named like a generation, or holds a manifest and is no save root."""
    path = Path(path)
    return parse_generation_dir_name(path.name) is not None or ((path / MANIFEST).is_file() and not is_save_root(path))


def is_save_root(path: Path) -> bool:
    """Whether `path` is a directory holding a generation, staging directory, tracker or lease."""
    path = Path(path)
    return path.is_dir() and _has_root_markers(os.listdir(path))


def find_save_roots(path: Path) -> list[Path]:
    """The save roots directly below `path`, or in its `<name>/checkpoints`, sorted.

    The second form is a multi-LoRA save directory: one slot root per adapter. Empty when `path` is
    a root, a generation or a symlink, or holds none; a link is never followed out of its root.
    Unreadable entries are skipped, never raised.
    """
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir() or is_save_root(path) or is_generation_dir(path):
            return []
        names = sorted(os.listdir(path))
    except OSError:
        return []
    roots = []
    for name in names:
        for candidate in (path / name, path / name / "checkpoints"):
            try:
                if not candidate.is_symlink() and is_save_root(candidate):
                    roots.append(candidate)
                    break
            except OSError:
                continue
    return roots


def is_legacy_miles_dir(path: Path) -> bool:
    """Whether `path` is a stock Miles adapter directory (`adapter_megatron_rank*.pt`, ...)."""
    path = Path(path)
    return path.is_dir() and any(n.startswith(LEGACY_MARKERS) and n.endswith(".pt") for n in os.listdir(path))


@dataclass
class Resolution:
    """What a path resolved to: the generation, the damaged newer ones skipped, and warnings."""

    generation: Generation
    skipped: list[Generation]
    warnings: list[str]


def resolve(path: Path, *, content: bool = True, key: Any = signing.FROM_SETTINGS) -> Resolution:
    """The generation `path` stands for, verified, and the damaged newer ones that were skipped.

    Raises GenerationDamaged for a damaged explicit generation, or when no generation of a root is
    intact; NotACheckpoint when `path` is not a checkpoint at all.
    """
    key = signing.resolve(key)
    candidates = find_candidates(path, key=key)
    skipped: list[Generation] = []
    for candidate in candidates.paths:
        gen = verify_generation(candidate, key=key) if content else check_structure(candidate, key=key)
        if gen.intact:
            return Resolution(gen, skipped, candidates.warnings)
        skipped.append(gen)
    first = skipped[0]
    raise GenerationDamaged(str(first.path), first.problems)
