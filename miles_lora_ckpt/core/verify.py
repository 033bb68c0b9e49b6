"""Strict verification of generations and resolution of save roots. Imports neither megatron nor Miles.

`check_structure` looks at names, the manifest and sizes (stat calls only); `check_file_content`
reads one file and checks its digest, safetensors header and, where the manifest asks, finiteness.
`verify_generation` does both for every file; loaders instead read each file once through
`check_file_content` and agree on the result (see `protocol.open_generation`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from miles_lora_ckpt.core import storage
from miles_lora_ckpt.core.errors import GenerationDamaged, NotACheckpoint, NothingCommitted, Problem
from miles_lora_ckpt.core.layout import (
    MANIFEST,
    TRACKER,
    FileRecord,
    Manifest,
    is_staging_dir_name,
    parse_generation_dir_name,
)

LEGACY_MARKERS = ("adapter_megatron_rank", "training_state_rank", "adapter_megatron_tp")


@dataclass
class Generation:
    """A committed-looking generation directory and, when it parsed, its manifest."""

    path: Path
    manifest: Manifest | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return self.manifest is not None and not self.problems


def check_structure(gen_dir: Path) -> Generation:
    """Manifest self-digest, name consistency, every listed file present with its size, no
    unlisted file, no path escaping the generation, no symlink. Reads only the manifest."""
    gen_dir = Path(gen_dir)
    if gen_dir.is_symlink():
        return Generation(gen_dir, None, [Problem(".", "generation directory is a symlink")])
    try:
        raw = storage.read_file_verified(_regular_file(gen_dir / MANIFEST))
        manifest = Manifest.from_json_bytes(bytes(raw))
    except (OSError, ValueError) as exc:
        return Generation(gen_dir, None, [Problem(MANIFEST, _reason(exc))])
    problems = _name_problems(gen_dir, manifest)
    problems += _listing_problems(gen_dir, manifest.files)
    return Generation(gen_dir, manifest, problems)


def check_file_content(gen_dir: Path, relpath: str, record: FileRecord) -> bytearray:
    """Read one listed file; check size, digest and format. Returns its bytes; raises ValueError."""
    buf = storage.read_file_verified(Path(gen_dir) / relpath, record)
    if relpath.endswith(".safetensors"):
        _, entries = storage.parse_safetensors_header(buf)
        if record.finite:
            storage.tensors_from_buffer(buf, entries, require_finite=True)
    elif relpath.endswith(".json"):
        storage.parse_json(buf)
    return buf


def verify_generation(gen_dir: Path) -> Generation:
    """Structure and the content of every file."""
    generation = check_structure(gen_dir)
    if generation.manifest is None:
        return generation
    listed_problem_files = {p.file for p in generation.problems}
    for relpath, record in sorted(generation.manifest.files.items()):
        if relpath in listed_problem_files:
            continue
        try:
            check_file_content(gen_dir, relpath, record)
        except (OSError, ValueError) as exc:
            generation.problems.append(Problem(relpath, _reason(exc)))
    return generation


def _regular_file(path: Path) -> Path:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise ValueError("is a symlink")
    if not stat.S_ISREG(mode):
        raise ValueError("is not a regular file")
    return path


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


def _listing_problems(gen_dir: Path, files: dict[str, FileRecord]) -> list[Problem]:
    problems = [Problem(rel, why) for rel in files if (why := _unsafe_relpath(rel))]
    present: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(gen_dir, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(gen_dir).as_posix()
            if full.is_symlink():
                problems.append(Problem(rel, f"symlink to {os.readlink(full)} (not allowed in a generation)"))
            elif name in filenames:
                present.add(rel)
    for rel in sorted(present - set(files) - {MANIFEST}):
        problems.append(Problem(rel, "not listed in the manifest (extra or renamed file)"))
    for rel, record in sorted(files.items()):
        if rel not in present:
            if not any(p.file == rel for p in problems):
                problems.append(Problem(rel, "listed in the manifest but missing"))
            continue
        size = (gen_dir / rel).stat().st_size
        if size != record.bytes:
            problems.append(Problem(rel, f"size is {size} bytes, manifest says {record.bytes} (truncated or grown)"))
    return problems


def _unsafe_relpath(rel: str) -> str | None:
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or rel != pure.as_posix() or rel in ("", "."):
        return "path escapes the generation directory"
    if rel == MANIFEST:
        return "the manifest may not list itself"
    return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}"
    return str(exc)


# --------------------------------------------------------------------------- save roots


@dataclass
class RootEntry:
    """One directory of a save root, for `ls` and `gc`."""

    name: str
    state: str  # committed | damaged | staging | deleting
    iteration: int | None
    created_unix_ns: int | None = None
    problems: list[Problem] = field(default_factory=list)


def is_generation_dir(path: Path) -> bool:
    return parse_generation_dir_name(Path(path).name) is not None or (Path(path) / MANIFEST).exists()


def is_save_root(path: Path) -> bool:
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / TRACKER).exists() or any(
        parse_generation_dir_name(n) or is_staging_dir_name(n) for n in os.listdir(path)
    )


def is_legacy_miles_dir(path: Path) -> bool:
    """A stock Miles adapter directory (`adapter_megatron_rank*.pt`, ...), which has no manifest."""
    path = Path(path)
    return path.is_dir() and any(n.startswith(LEGACY_MARKERS) and n.endswith(".pt") for n in os.listdir(path))


def scan_root(root: Path, *, content: bool = False) -> list[RootEntry]:
    """Every generation, staging and deleting directory of `root`, newest commit first."""
    root = Path(root)
    entries = []
    for name in sorted(os.listdir(root)):
        if is_staging_dir_name(name):
            entries.append(RootEntry(name, "staging", None))
        elif name.startswith(".deleting-"):
            entries.append(RootEntry(name, "deleting", None))
        elif (parsed := parse_generation_dir_name(name)) is not None:
            gen = verify_generation(root / name) if content else check_structure(root / name)
            # a damaged generation without a readable manifest is dated by its directory
            created = gen.manifest.created_unix_ns if gen.manifest else (root / name).stat().st_mtime_ns
            problems = [Problem(f"{name}/{p.file}", p.reason) for p in gen.problems]
            entries.append(RootEntry(name, "committed" if gen.intact else "damaged", parsed[0], created, problems))
    return sorted(entries, key=_newest_first_key, reverse=True)


def _newest_first_key(entry: RootEntry) -> tuple:
    # Commit order, not iteration: a run restarted from an older generation commits lower
    # iterations after higher ones, and its newest commit is the one to resume from.
    return (entry.created_unix_ns or 0, entry.iteration or -1, entry.name)


def read_tracker(root: Path) -> str | None:
    """The generation directory name the tracker names, or None when there is no usable tracker."""
    try:
        data = storage.read_json(Path(root) / TRACKER)
        name = data["generation_dir"]
        return name if parse_generation_dir_name(name) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def committed_candidates(path: Path) -> tuple[list[Path], bool]:
    """Generation directories to try for `path`, newest first, and whether `path` is a root.

    An explicit generation directory is the only candidate. Raises NotACheckpoint when `path`
    holds no generation at all (a legacy Miles directory included: it has no manifest).
    """
    path = Path(path)
    if not path.exists():
        raise NotACheckpoint(f"{path} does not exist")
    if is_staging_dir_name(path.name):
        raise GenerationDamaged(str(path), [Problem(".", "uncommitted staging directory (in progress or abandoned)")])
    if is_generation_dir(path):
        return [path], False
    if not is_save_root(path):
        kind = "a legacy Miles adapter directory (no manifest)" if is_legacy_miles_dir(path) else "not a checkpoint"
        raise NotACheckpoint(f"{path} is {kind}")
    names = [e.name for e in scan_root(path) if e.state in ("committed", "damaged")]
    if not names:
        raise NothingCommitted(str(path), [Problem(".", "save root has no committed generation (only staging)")])
    return [path / n for n in names], True


def resolve(path: Path, *, content: bool = True) -> tuple[Generation, list[Generation]]:
    """The generation `path` stands for, verified, and the damaged newer ones that were skipped.

    Raises GenerationDamaged for a damaged explicit generation, or when no generation of a root is
    intact; NotACheckpoint when `path` is not a checkpoint at all.
    """
    candidates, _ = committed_candidates(path)
    skipped: list[Generation] = []
    for candidate in candidates:
        gen = verify_generation(candidate) if content else check_structure(candidate)
        if gen.intact:
            return gen, skipped
        skipped.append(gen)
    first = skipped[0]
    raise GenerationDamaged(str(first.path), first.problems)
