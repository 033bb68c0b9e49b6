"""The crash-safe checkpoint protocol every saver and loader goes through.

Save, read top to bottom as phases::

    prepare   coordinator takes the root's writer lease (a second writer is
              refused here, before anything is written), removes the staging
              directories crashed attempts left, numbers the generation
              (sequence = 1 + the highest in the root), picks a fresh attempt
              id and makes `.staging-<id>`                                  -> agree
    produce   (optional) the caller's collective step on every rank, such as
              a collective export whose result the coordinator writes next;
              it agrees each of its own steps                               -> agree(s)
    write     every rank writes its own files into the staging directory,
              each tensor file stamped with generation, path and binding    -> agree (records)
              (with `write_produced`, produce runs after this write instead,
              then `write-produced` writes its result                       -> agree)
    commit    coordinator writes manifest.json last, inside the staging dir
              (signed when a key is configured)                             -> agree
    publish   coordinator checks it still holds the lease, renames staging
              to gen-<iter>-<id> (one atomic rename: committed), replaces the
              tracker and any links; a later failure is `CommittedButFailed` -> agree
    retain    coordinator prunes old generations; after the last collective,
              so it never raises

A failed attempt raises the same CheckpointError on every rank, and its staging directory is
removed. One left by a killed process is never read; the next save removes it at prepare.

Load, read top to bottom as phases::

    look ahead  every rank plans the generation the tracker names and reads
                its own files of it, verified (nothing is trusted yet)
    resolve     coordinator lists the candidates in commit order; the round
                hands out the listing with every rank's plan and what its read
                found                                                       -> agree
    plan        (when some rank guessed another generation) every rank checks
                a candidate's structure and names the files it needs       -> agree
    read        every rank reads its files or element ranges (`PartialRead`),
                verified, and a round-robin share of the files and blocks
                nobody reads, so some rank verifies every listed byte      -> agree
                (not held where every rank guessed the newest candidate and
                every listed byte is some rank's to read: the resolve round
                carried every verdict)

A root skips a damaged generation with a warning, and plans and reads the next. Nothing is mutated
here: callers preflight before touching model or optimizer.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from miles_lora_ckpt.core import (
    atomic_files,
    attempts,
    checked_reads,
    faults,
    file_reader,
    host_memory,
    json_files,
    lease,
    partial_reads,
    read_ahead,
    retention,
    safetensors_write,
    signing,
)
from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt, settle
from miles_lora_ckpt.core.errors import CheckpointError, CommittedButFailed, GenerationDamaged, RankFailure
from miles_lora_ckpt.core.layout import (
    GENERATION_PREFIX,
    LATEST,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_SEQUENCE,
    STAGING_PREFIX,
    STAMP_KEYS,
    TRACKER,
    FileRecord,
    Manifest,
    Topology,
    Tracker,
    generation_dir_name,
    new_attempt_id,
    parse_generation_dir_name,
    staging_dir_name,
)
from miles_lora_ckpt.core.verify import (
    DAMAGE,
    Generation,
    check_file_content,
    check_file_ranges,
    check_structure,
    damage_problems,
    find_candidates,
    follow_generation_link,
    tracked_generation,
)

__all__ = [
    "DeferredRanges",
    "OpenedGeneration",
    "PartialRead",
    "StagingWriter",
    "WholeFileRanges",
    "next_sequence",
    "open_generation",
    "save_generation",
]

log = logging.getLogger(__name__)


class StagingWriter:
    """What one rank may do during the write phase: put files into the attempt's staging directory.

    Every tensor file is stamped in its own metadata with its generation, its path and the saver's
    `binding` (role, coordinate, optimizer child). The manifest records the binding too, and every
    reader checks both agree. So a file copied from another generation, or swapped, is refused.
    JSON files record their binding in the manifest only.
    """

    def __init__(self, staging: Path, rank: int, generation: str):
        self.staging = staging
        self.rank = rank
        self.generation = generation
        self.records: dict[str, FileRecord] = {}

    def write_tensors(
        self,
        relpath: str,
        tensors,
        *,
        metadata: dict[str, str] | None = None,
        binding: dict[str, str] | None = None,
        finite: bool = True,
        blocks: bool = False,
    ) -> None:
        """Write one safetensors file at `relpath`; values may be `safetensors_write.LazyTensor`s.

        `blocks=True` records block digests, so loaders may read and verify parts of it. Raises as
        `safetensors_write.save_tensors` does.
        """
        binding = _checked_binding(binding)
        stamp = {"generation": self.generation, "file": relpath, **binding}
        clash = sorted(set(metadata or {}) & set(stamp))
        if clash:
            raise ValueError(f"{relpath}: metadata keys {clash} are reserved for the generation stamp and binding")
        record = safetensors_write.save_tensors(
            self._target(relpath), tensors, metadata={**(metadata or {}), **stamp}, finite=finite, blocks=blocks
        )
        self._record(relpath, replace(record, binding=binding))

    def write_json(self, relpath: str, obj, *, binding: dict[str, str] | None = None) -> None:
        """Write one JSON file at `relpath` in the plugin's own form (`json_files.json_bytes`)."""
        record = json_files.write_json(self._target(relpath), obj)
        self._record(relpath, replace(record, binding=_checked_binding(binding)))

    def write_bytes(self, relpath: str, data: bytes, *, binding: dict[str, str] | None = None) -> None:
        """Write one file of already-encoded bytes, recorded and bound like any file.

        It is for a format whose bytes another tool defines, such as PEFT's `adapter_config.json`.
        """
        record = atomic_files.write_file_atomic(self._target(relpath), [bytes(data)])
        self._record(relpath, replace(record, binding=_checked_binding(binding)))

    def _target(self, relpath: str) -> Path:
        if relpath in self.records:
            raise ValueError(f"{relpath} written twice by rank {self.rank}")
        target = self.staging / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def _record(self, relpath: str, record: FileRecord) -> None:
        self.records[relpath] = record
        if len(self.records) == 1:
            faults.point("mid-write", self.rank)

    def sync_dirs(self) -> None:
        """Fsync every directory this rank wrote into, deepest first; OSError propagates."""
        for directory in sorted({(self.staging / rel).parent for rel in self.records}, reverse=True):
            atomic_files.fsync_dir(directory)


def _checked_binding(binding: dict[str, str] | None) -> dict[str, str]:
    binding = dict(binding or {})
    for key, value in binding.items():
        if key in STAMP_KEYS or not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"bad binding {key!r}: {value!r} (string keys other than {STAMP_KEYS}, string values)")
    return binding


WriteFn = Callable[[StagingWriter], None]
ProduceFn = Callable[[Consensus], dict | None]


def save_generation(
    consensus: Consensus,
    root: str | os.PathLike,
    *,
    iteration: int,
    saver: str,
    topology: Topology,
    write_files: WriteFn,
    metadata: dict | None = None,
    keep: int | None = None,
    produce: ProduceFn | None = None,
    link_latest: bool = False,
    links: Sequence[str] = (),
    write_produced: WriteFn | None = None,
) -> Path:
    """Collective. Write one generation of `root` through all phases; returns its directory.

    `write_files(writer)` runs on every rank and writes that rank's files, possibly none.
    `metadata` (JSON) goes into the manifest; `keep` prunes to the newest N generations afterwards.

    `produce(consensus)`, when given, is the caller's own collective step, such as a collective
    export. It runs on every rank after prepare and before the write phase. It must pass every
    failure through `consensus.agree`, and may return manifest metadata to add; a key in both is an
    error. With `write_produced(writer)` too, the write phase runs first, then `produce`, then a
    second write phase, `write-produced`, where every rank writes what `produce` made. A file
    written in both phases is an error.

    `link_latest` also points the relative symlink `<root>/latest` at the new generation. `links`
    names more such symlinks, one path component each, such as Miles' `step_N` reader names. Each
    is replaced atomically and made durable with the rename. A protocol name (`gen-*`, the
    tracker, ...) raises ValueError; an existing entry that is not a symlink is refused at prepare.

    Raises the same CheckpointError on every rank if any rank fails any phase, another writer's
    lease included. The previous generation, tracker and links are then untouched, and the staging
    directory is removed. A failure after the publishing rename raises `CommittedButFailed` on
    every rank instead, naming the generation, which is committed and loads.
    """
    root, rank = Path(root), consensus.rank
    coordinator = rank == 0
    links = ((LATEST,) if link_latest else ()) + tuple(check_link_name(name) for name in links)

    # Prepare: the coordinator takes the lease, numbers the generation, makes its staging directory.
    prepared = attempt(_prepare if coordinator else _prepare_bystander, root, links, rank)
    try:
        attempt_id, sequence = consensus.agree("prepare", prepared.map(lambda p: [p.attempt_id, p.sequence]))[0]
        staging, key = root / staging_dir_name(attempt_id), prepared.value.key  # the key: coordinator only

        # Produce (optional): the caller's collective step, each of its steps agreed by itself.
        produce_first = produce is not None and write_produced is None
        produced = produce(consensus) if produce_first else None

        # Write: each rank its own files.
        records_by_rank = consensus.agree("write", attempt(_write_rank_files, staging, attempt_id, rank, write_files))

        # Produce after the write (with write_produced), then write what it produced.
        if produce is not None and not produce_first:
            produced = produce(consensus)
            written = records_by_rank[rank]
            more = attempt(_write_produced, staging, attempt_id, rank, write_produced, written)
            records_by_rank = [
                {**a, **b} for a, b in zip(records_by_rank, consensus.agree("write-produced", more), strict=True)
            ]

        # Commit: the coordinator writes the manifest last, still inside the staging directory.
        manifest = Manifest(
            generation=attempt_id,
            iteration=iteration,
            saver=saver,
            topology=topology,
            files={},
            metadata=metadata or {},
            sequence=sequence,
        )
        commit = _write_manifest if coordinator else _bystander(COMMIT_FAULTS)
        consensus.agree("commit", attempt(commit, staging, manifest, records_by_rank, produced, key, rank))

        # Publish: if still the lease holder, one atomic rename makes the generation visible, and
        # the tracker and links name it.
        final = root / generation_dir_name(iteration, attempt_id)
        publish = _publish if coordinator else _bystander_publish
        published = consensus.agree("publish", attempt(publish, staging, final, manifest, links, rank))
        # Past the rename the generation is committed: a later failure names it, on every rank.
        after = [RankFailure(r, p["after"]) for r, p in enumerate(published) if p["after"] is not None]
        if after:
            raise CommittedButFailed(final.name, after)
    except BaseException:
        if coordinator and prepared.ok:  # nothing was published from it (or it is gone: renamed)
            _discard(root / staging_dir_name(prepared.value.attempt_id))
        raise
    finally:
        if coordinator and prepared.ok:
            attempts.end(root, staging_dir_name(prepared.value.attempt_id))

    # Retain: after the last collective, so it must not raise.
    if coordinator and keep is not None:
        retention.prune_quietly(root, keep=keep, trusted=(final.name,))
    return final


@dataclass
class _Prepared:
    attempt_id: str
    sequence: int
    key: signing.SigningKey | None  # stays on the coordinator


def _prepare(root: Path, links: tuple[str, ...], rank: int) -> _Prepared:
    # No fsync of the staging directory: one lost in a crash is an attempt that never happened.
    key = signing.configured_key()
    root.mkdir(parents=True, exist_ok=True)
    for link in links:
        if os.path.lexists(root / link) and not os.path.islink(root / link):
            raise ValueError(f"{root / link} is not a symlink; refusing to replace it with one")
    lease.acquire(root)
    retention.reclaim_staging(root)  # what crashed attempts left: no live attempt owns it
    sequence = next_sequence(root, key)
    attempt_id = new_attempt_id()
    directory = root / staging_dir_name(attempt_id)
    attempts.begin(root, directory.name)  # ours and live: no reclaim (another thread's save) removes it
    try:
        directory.mkdir()  # fails if it exists: never reused
        faults.point("after-prepare", rank)
    except BaseException:
        _discard(directory)  # its id never reached the other ranks: nobody else would remove it
        attempts.end(root, directory.name)
        raise
    return _Prepared(attempt_id, sequence, key)


def _prepare_bystander(root: Path, links: tuple[str, ...], rank: int) -> _Prepared:
    faults.point("after-prepare", rank)  # nothing to prepare here, but the fault phase fires on every rank
    return _Prepared("", 0, None)


def _discard(staging: Path) -> None:
    """Remove a failed attempt's staging directory, best effort (never follows a link)."""
    shutil.rmtree(staging, ignore_errors=True)


def next_sequence(root: Path, key: signing.SigningKey | None) -> int:
    """1 + the highest sequence among the root's committed manifests.

    Damaged generations keep their numbers, so a sequence is never reused while its generation is
    there. With a key configured, only properly signed manifests count, so a forged one cannot
    exhaust the numbers. The tracker is an unsigned hint: a higher sequence there is a warning,
    never a number, since a forged 2^62 would stop every later save.
    """
    highest, holder = 0, None
    for name in os.listdir(root):
        if parse_generation_dir_name(name) is None:
            continue
        try:
            manifest = Manifest.from_json_bytes(
                file_reader.read_file_verified(root / name / MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
            )
        except DAMAGE:  # an unreadable manifest holds no usable number
            continue
        if manifest.sequence is None or signing.problem(manifest.signature, manifest.sealed_body, key) is not None:
            continue
        if manifest.sequence > highest:
            highest, holder = manifest.sequence, name
    try:
        tracked = Tracker.from_dict(json_files.read_json(root / TRACKER))
    except DAMAGE:  # a missing or unusable tracker adds nothing
        tracked = None
    # A tracker that agrees with a counted manifest claims that manifest's number, already counted.
    # A higher claim agrees with no generation here: forged, or its generation was removed.
    if tracked is not None and tracked.sequence is not None and tracked.sequence > highest:
        log.warning(
            "%s: the tracker claims sequence %d for %s, which no generation of this root with that "
            "manifest holds (the highest is %d): not counted (the tracker is an unsigned hint)",
            root,
            tracked.sequence,
            tracked.generation_dir,
            highest,
        )
    if highest >= MAX_SEQUENCE:
        raise ValueError(f"{root}: {holder} claims sequence {highest}, the last one there is; save to a new root")
    return highest + 1


def _write_rank_files(staging: Path, generation: str, rank: int, write_files: WriteFn) -> dict:
    faults.point("before-write", rank)
    writer = StagingWriter(staging, rank, generation)
    write_files(writer)
    if not writer.records:
        faults.point("mid-write", rank)  # a rank with nothing to write still passes every phase
    writer.sync_dirs()
    faults.point("after-write", rank)
    return {rel: rec.to_dict() for rel, rec in writer.records.items()}


def _write_produced(staging: Path, generation: str, rank: int, write_fn: WriteFn, written: dict) -> dict:
    writer = StagingWriter(staging, rank, generation)
    write_fn(writer)
    twice = sorted(set(writer.records) & set(written))
    if twice:
        raise ValueError(f"{twice} written in both write phases by rank {rank}")
    writer.sync_dirs()
    return {rel: rec.to_dict() for rel, rec in writer.records.items()}


COMMIT_FAULTS = ("after-consensus", "mid-manifest", "before-publish")
PUBLISH_FAULTS = ("after-publish",)


def _bystander(phases: tuple[str, ...]):
    """Non-coordinators do no commit or publish work, but every fault phase can fire on any rank."""

    def run(*args) -> None:
        for phase in phases:
            faults.point(phase, args[-1])

    return run


def _write_manifest(
    staging: Path,
    manifest: Manifest,
    records_by_rank: list[dict],
    produced: dict | None,
    key: signing.SigningKey | None,
    rank: int,
) -> None:
    faults.point("after-consensus", rank)
    manifest.files = _merge_records(records_by_rank)
    manifest.metadata = _merge_metadata(manifest.metadata, produced)
    body = manifest.to_json_bytes(key)
    half = len(body) // 2

    def manifest_chunks():
        yield body[:half]
        faults.point("mid-manifest", rank)
        yield body[half:]

    atomic_files.write_file_atomic(staging / MANIFEST, manifest_chunks())
    atomic_files.fsync_dir(staging)
    faults.point("before-publish", rank)


def _publish(staging: Path, final: Path, manifest: Manifest, links: tuple[str, ...], rank: int) -> dict:
    """The rename that commits, then what follows it.

    A failure before the rename raises, since nothing was committed. One after it is returned as
    `after`: the generation is committed regardless.
    """
    lease.confirm(final.parent)  # lost it (stalled past the timeout)? then the root is another writer's
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    os.rename(staging, final)
    return {"after": attempt(_after_rename, final, manifest, links, rank).error}


def _bystander_publish(staging: Path, final: Path, manifest: Manifest, links: tuple[str, ...], rank: int) -> dict:
    return {"after": attempt(_bystander(PUBLISH_FAULTS), rank).error}


def _after_rename(final: Path, manifest: Manifest, links: tuple[str, ...], rank: int) -> None:
    tracker = Tracker(final.name, manifest.generation, manifest.iteration, manifest.sequence)
    json_files.write_json(final.parent / TRACKER, tracker.to_dict())
    for link in links:
        point_link(final.parent, link, final.name)
    atomic_files.fsync_dir(final.parent)  # makes the rename, the tracker and the links durable together
    faults.point("after-publish", rank)


def point_link(root: Path, link: str, name: str) -> None:
    """Make `root/link` a relative symlink to `name`, replacing the old one in one atomic step."""
    tmp = root / f".{link}.tmp-{secrets.token_hex(4)}"
    os.symlink(name, tmp)  # relative: the root can be moved or mounted elsewhere
    try:
        os.replace(tmp, root / link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_link_name(name: str) -> str:
    """`name` if the publish may point a symlink of that name at a generation.

    Raises ValueError if it is not one plain path component, or is one of the protocol's own names.
    """
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\0" in name
        or name.startswith(".")
        or name in (TRACKER, MANIFEST, LATEST)
        or name.startswith((GENERATION_PREFIX, STAGING_PREFIX))
    ):
        raise ValueError(f"{name!r} cannot be a generation link: one path component, not a protocol name")
    return name


def _merge_metadata(metadata: dict, produced: dict | None) -> dict:
    if produced is None:
        return metadata
    if not isinstance(produced, dict):
        raise TypeError(f"the produce step returned {type(produced).__name__}, not a metadata dict (or None)")
    clash = sorted(set(metadata) & set(produced))
    if clash:
        raise ValueError(f"metadata keys {clash} given both by the caller and by its produce step")
    return {**metadata, **produced}


def _merge_records(records_by_rank: list[dict]) -> dict[str, FileRecord]:
    merged: dict[str, FileRecord] = {}
    owner: dict[str, int] = {}
    for rank, records in enumerate(records_by_rank):
        for rel, rec in records.items():
            if rel in merged:
                raise ValueError(f"{rel} written by both rank {owner[rel]} and rank {rank}")
            merged[rel], owner[rel] = FileRecord.from_dict(rec), rank
    return merged


# --------------------------------------------------------------------------- load


@dataclass
class OpenedGeneration:
    """A generation all ranks agreed on, with this rank's files read and checked."""

    path: Path
    manifest: Manifest
    files: dict[str, checked_reads.CheckedFile]
    warnings: list[str] = field(default_factory=list)  # skipped generations, tracker disagreements
    ranges: dict[str, dict] = field(default_factory=dict)  # relpath -> {(name, first, stop): tensor}

    def tensors(self, relpath: str):
        """Zero-copy tensors of one of this rank's files (already checked)."""
        return self.files[relpath].tensors()

    def tensor_ranges(self, relpath: str):
        """`{(name, first, stop): 1-D tensor}`: the checked ranges this rank asked of `relpath`.

        For a file this rank read whole, it cuts any range from it. `.get` raises GenerationDamaged,
        a ValueError, for a tensor or range the file does not hold.
        """
        if relpath in self.ranges:
            return self.ranges[relpath]
        return WholeFileRanges(self.tensors(relpath))

    def json(self, relpath: str):
        """A fresh copy of one of this rank's JSON files (already checked)."""
        return json_files.parse_json(self.files[relpath].buffer, what=relpath)

    def binding(self, relpath: str) -> dict[str, str]:
        """What the manifest says the file is (format v2; empty for v1)."""
        return dict(self.manifest.files[relpath].binding)

    @property
    def buffers(self) -> dict[str, bytearray]:
        """`{relpath: bytes}` of this rank's files read whole, already checked."""
        return {rel: checked.buffer for rel, checked in self.files.items()}


class DeferredRanges:
    """The element ranges of one file, all verified at open; `PartialRead(keep=True)` ones kept.

    `.get` returns a kept range as it is, and reads any other again, verified again, when the caller
    is ready for it. So memory holds one such range at a time. `.drop` forgets a kept range after
    its last use, so its memory goes back.
    """

    def __init__(self, gen_dir: Path, relpath: str, manifest: Manifest, kept: dict | None = None):
        self.gen_dir, self.relpath, self.manifest = gen_dir, relpath, manifest
        self.kept = dict(kept or {})
        self._scratch = None  # the buffer `get(transient=True)` reads into, reused

    def get(self, wanted, default=None, *, transient: bool = False):
        """A kept range, or one read and verified again; raises `DAMAGE` for what it finds.

        With `transient=True` a range read again lands in a buffer reused for the next transient
        read, so no fresh memory faults in. The caller must be done with the tensor before then.
        """
        item = tuple(wanted)
        if item in self.kept:
            return self.kept[item]
        allocate = self._reused if transient else host_memory.large_buffer
        return check_file_ranges(self.gen_dir, self.relpath, self.manifest, [item], allocate=allocate)[item]

    def _reused(self, nbytes: int):
        if self._scratch is None or len(self._scratch) < nbytes:
            self._scratch = None  # the old one goes before the new one is made
            self._scratch = host_memory.large_buffer(nbytes)
        return memoryview(self._scratch)[:nbytes]

    def release(self) -> None:
        """Give back the buffer of transient reads."""
        self._scratch = None

    def drop(self, wanted) -> None:
        """Forget kept range `wanted` after its last use, so its memory goes back."""
        self.kept.pop(tuple(wanted), None)


class WholeFileRanges:
    """Element ranges cut from the tensors of a file read whole (`OpenedGeneration.tensor_ranges`).

    `.get` raises GenerationDamaged, a ValueError, for a tensor or range the file does not hold.
    """

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def get(self, wanted, default=None):
        """Element range `wanted`, cut from the file's tensors; GenerationDamaged if it lacks it."""
        return _cut_one(self.tensors, tuple(wanted))


@dataclass(frozen=True)
class PartialRead:
    """A loader's request for some element ranges of one tensor file.

    A range is `(tensor name, first, stop)` of the flattened tensor, or a strided range whose rows
    come back compact (`partial_reads.strided_rows`). Only the blocks holding them are read when
    the file has a block index; otherwise the whole file is. A rank's requests of one file are
    read in one verified pass (`verify.check_file_ranges`). With `keep=False` they are verified
    then, not kept, and read again at install (`DeferredRanges`), so one is in memory at a time.
    """

    relpath: str
    ranges: tuple[partial_reads.ElementRange, ...]
    keep: bool = True  # False: verify now, one range at a time; read again later (`DeferredRanges`)


# Returns relpaths (whole files) and PartialReads. Raises GenerationDamaged for damage, and
# IncompatibleCheckpoint to refuse the load; anything else is a bug and fails the load too.
FilesFn = Callable[[Manifest], list]


def open_generation(consensus: Consensus, path: str | os.PathLike, files_for_rank: FilesFn) -> OpenedGeneration:
    """Collective. Resolve `path`, a save root or one generation, and read this rank's files.

    Every rank reads `files_for_rank(manifest)`, whole files and `PartialRead` ranges, with every
    content check. Files and blocks no rank reads are verified round-robin. Returns the
    `OpenedGeneration` all ranks agreed on; it mutates nothing.

    A root falls back past damaged generations with a warning; damage is `GenerationDamaged`, or
    an `OSError` reading a listed file. An explicit damaged generation fails the load with the same
    CheckpointError on every rank. So does any other exception, such as `IncompatibleCheckpoint` or
    a bug: it never falls back to older state.
    """
    rank, world = consensus.rank, consensus.world_size
    # Look ahead: each rank plans the generation the root's tracker names and reads its own files
    # of it, verified, before the first round; so the load waits on the disk once, then agrees.
    # Nothing is trusted: the plan and the read count only where the agreed listing starts with
    # that generation.
    local = attempt(_resolve_locally, Path(path), rank == 0)
    ahead = _look_ahead(Path(path), files_for_rank, local.value[0], rank) if local.ok else None
    # Resolve: every rank loads its signing key, and the coordinator lists the candidates in commit
    # order, tracker disagreements as warnings. One round checks every rank asks for the same thing
    # (`first`) and nobody failed, hands out the listing, and carries each rank's look-ahead.
    mine = {"path": str(path), "listing": local.value[1] if local.ok else None, "error": local.error}
    everyone = consensus.agree("resolve", Outcome.success({**mine, "ahead": ahead and ahead.to_json()}))
    if len({entry["path"] for entry in everyone}) > 1:
        detail = [RankFailure(r, f"has {json.dumps(e['path'], sort_keys=True)}") for r, e in enumerate(everyone)]
        raise CheckpointError("resolve (ranks disagree)", detail)
    failures = [RankFailure(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
    if failures:
        raise CheckpointError("resolve", failures)
    candidates, is_root, warnings = everyone[0]["listing"]
    key = local.value[0]
    for warning in warnings:
        log.warning("%s: %s", path, warning)
    # Where every rank guessed the newest candidate, its plan round is the one just held.
    guessed = bool(candidates) and all(e["ahead"] and e["ahead"]["guess"] == candidates[0] for e in everyone)
    damage: list[RankFailure] = []
    for candidate in map(Path, candidates):
        early = guessed and str(candidate) == candidates[0]
        # The look-ahead serves its own generation only. A guess not taken, and the read of a
        # damaged candidate, let their buffers go before the next read.
        here, ahead, own = (ahead if ahead is not None and ahead.guess == candidate else None), None, None
        # Plan: every rank checks the structure once and names the files it needs.
        planned = here.planned if here is not None else attempt(_plan_reads, candidate, files_for_rank, key)
        if early:
            plans = settle("resolve", [Outcome.from_json(e["ahead"]["plan"]) for e in everyone])
        else:
            plans = consensus.agree("resolve", planned.map(lambda p: p[1]))
        problems = [RankFailure(r, p) for r, plan in enumerate(plans) for p in plan["problems"]]
        problems = problems or _manifest_mismatch(candidate, plans)
        if not problems:
            # Read: own files and ranges, then a round-robin share of what nobody reads. Damage
            # found in a file is a verdict; any other error fails the load on every rank.
            manifest = planned.value[0].manifest
            shares = _shares(manifest, plans, world)
            own = here.read if here is not None else attempt(_read_own, rank, candidate, manifest, plans[rank])
            unread = any(files or blocks for files, blocks in shares)
            if early and not unread:  # the look-ahead read everything: its verdicts came with the listing
                verdicts = settle("read", [Outcome.from_json(e["ahead"]["read"]) for e in everyone])
            else:
                # The own read's verdict goes with the share's; a failed own read fails the round.
                checked = attempt(_check_share, candidate, manifest, shares[rank], own.value[2]) if own.ok else own
                verdicts = consensus.agree("read", checked)
            problems = [RankFailure(r, p) for r, v in enumerate(verdicts) for p in v]
            if not problems:
                files, ranges, _ = own.value
                return OpenedGeneration(candidate, manifest, files, warnings, ranges)
        damage += problems
        if not is_root:
            break
        skipped = f"skipping damaged generation {candidate}: " + "; ".join(f.error for f in problems)
        log.warning("%s", skipped)
        warnings = [*warnings, skipped]
    raise CheckpointError("verify", damage or [RankFailure(0, f"no intact generation under {path}")])


@dataclass
class _LookAhead:
    """What one rank did before the first round: the generation it `guess`ed, its plan there
    (`_plan_reads`' outcome) and, where the plan named no problem, its own files read (`_read_own`'s)."""

    guess: Path
    planned: Outcome
    read: Outcome | None

    def to_json(self) -> dict:
        """As the resolve round carries it: the guess, and the plan and the read's verdict as the
        plan and read rounds would carry them."""
        return {
            "guess": str(self.guess),
            "plan": self.planned.map(lambda p: p[1]).to_json(),
            "read": self.read and self.read.map(lambda r: r[2]).to_json(),
        }


def _look_ahead(path: Path, files_for_rank: FilesFn, key, rank: int) -> _LookAhead | None:
    """The generation `path` is, or its save root's tracker names, planned and this rank's own
    files of it read and verified; None when it names none.

    The plan and the read are `_plan_reads`' and `_read_own`'s own, made early: `open_generation`
    uses them only for that generation.
    """
    path = follow_generation_link(path)
    guess = path if parse_generation_dir_name(path.name) is not None else tracked_generation(path)
    if guess is None:
        return None
    planned = attempt(_plan_reads, guess, files_for_rank, key)
    if not planned.ok or planned.value[1]["problems"]:
        return _LookAhead(guess, planned, None)
    gen, plan = planned.value
    return _LookAhead(guess, planned, attempt(_read_own, rank, guess, gen.manifest, plan))


def _resolve_locally(path: Path, coordinator: bool):
    """(this rank's signing key, and on the coordinator the JSON listing every rank agrees on)."""
    key = signing.configured_key()
    if not coordinator:
        return key, None
    found = find_candidates(path, key=key)
    return key, [[str(c) for c in found.paths], found.is_root, found.warnings]


def _plan_reads(candidate: Path, files_for_rank: FilesFn, key) -> tuple[Generation, dict]:
    """The checked structure, kept on this rank, and the JSON plan every rank agrees on.

    The plan holds `files` read whole and `ranges` read in part: `{relpath: [[name, first, stop]]}`.
    """
    gen = check_structure(candidate, key=key)
    if not gen.intact:
        problems = [f"{candidate / p.file}: {p.reason}" for p in gen.problems]
        return gen, {"files": [], "ranges": {}, "problems": problems, "manifest": None}
    seal = gen.manifest.sealed_digest  # what every rank's plan must share (`_manifest_mismatch`)
    try:
        wanted = files_for_rank(gen.manifest)
        whole = sorted({w for w in wanted if isinstance(w, str)})
        ranges: dict[str, list] = {}
        kept: set[tuple] = set()
        for request in (w for w in wanted if isinstance(w, PartialRead)):
            items = [[str(item[0]), *(int(v) for v in item[1:])] for item in request.ranges]
            ranges.setdefault(request.relpath, []).extend(items)
            if request.keep:
                kept.update((request.relpath, *item) for item in items)
        listed = gen.manifest.files
        for rel, items in ranges.items():
            index = listed[rel].blocks if rel in listed else None
            if index is None:  # no block index: read whole, the ranges are cut from it
                whole = sorted({*whole, rel})
            else:
                for item in items:
                    partial_reads.byte_range(index, tuple(item))  # raises for a range the file does not hold
    except DAMAGE as exc:  # what the manifest says is damaged; IncompatibleCheckpoint and bugs fail the load
        return gen, {"files": [], "ranges": {}, "problems": _damage_lines(candidate, exc, MANIFEST), "manifest": seal}
    missing = [
        f"{candidate / rel}: required by the loader but not in the manifest (torn or foreign generation)"
        for rel in sorted({*whole, *ranges})
        if rel not in gen.manifest.files
    ]
    # Ranges verified at open and read again later: those no request asked kept, of files not
    # read whole.
    deferred = {
        rel: [item for item in items if (rel, *item) not in kept]
        for rel, items in ranges.items()
        if rel not in whole and any((rel, *item) not in kept for item in items)
    }
    return gen, {"files": whole, "ranges": ranges, "deferred": deferred, "problems": missing, "manifest": seal}


def _manifest_mismatch(candidate: Path, plans: list[dict]) -> list[RankFailure]:
    """A problem for each rank whose plan was made from another manifest than rank 0's.

    Every rank reads the manifest itself; what each must check (`_shares`) and whether a read round
    is held follow from it, so they must all have read the same bytes.
    """
    first = plans[0]["manifest"]
    return [
        RankFailure(
            r, f"{candidate / MANIFEST}: changed while the load read it (digest {p['manifest']}, rank 0 read {first})"
        )
        for r, p in enumerate(plans)
        if p["manifest"] != first
    ]


def _shares(manifest: Manifest, plans: list[dict], world: int) -> list[tuple[list[str], dict[str, list[int]]]]:
    """Every rank's round-robin share of what nobody's plan reads, by rank: `(files, {file: blocks})`.

    Those are whole files no plan names and the unread blocks of files read in part. Every rank
    computes the same shares, from the agreed plans and the manifest they all read.
    """
    whole = {rel for plan in plans for rel in plan["files"]}
    partial = sorted({rel for plan in plans for rel in plan["ranges"]} - whole)
    unclaimed = sorted(set(manifest.files) - whole - set(partial))
    leftover = [(rel, block) for rel in partial for block in _unread_blocks(manifest.files[rel].blocks, rel, plans)]
    shares = []
    for rank in range(world):
        blocks: dict[str, list[int]] = {}
        for rel, block in leftover[rank::world]:
            blocks.setdefault(rel, []).append(block)
        shares.append((unclaimed[rank::world], blocks))
    return shares


def _read_own(rank: int, candidate: Path, manifest: Manifest, plan: dict):
    """`(files, ranges, problems)`: this rank's files and ranges of `plan`, read and verified, and
    the damage found in them, one line each."""
    faults.point("before-read", rank)
    # The first file's own reads start at once; the kernel reads ahead at the rest meanwhile.
    in_part = {rel: items for rel, items in plan["ranges"].items() if rel not in plan["files"]}
    _prefetch(candidate, manifest, plan["files"][1:], in_part, {})
    files, ranges, problems = {}, {}, []
    for rel in plan["files"]:
        try:
            files[rel] = check_file_content(candidate, rel, manifest)
        except DAMAGE as exc:  # damage of that file; anything else is a bug: it fails the load
            problems += _damage_lines(candidate, exc, rel)
    for rel, items in sorted(plan["ranges"].items()):
        try:
            wanted = [tuple(item) for item in items]
            if rel in files:  # read whole (no block index, or also asked whole): cut the ranges from it
                ranges[rel] = _cut(files[rel], wanted)
            elif rel not in plan["files"]:  # every range of the file in one verified pass
                later = {tuple(item) for item in plan.get("deferred", {}).get(rel, ())}
                kept = [item for item in wanted if item not in later]
                read = check_file_ranges(candidate, rel, manifest, kept, check_only=sorted(later))
                # The deferred ones were verified and dropped: read and verified again later.
                ranges[rel] = DeferredRanges(candidate, rel, manifest, read) if later else read
        except DAMAGE as exc:
            problems += _damage_lines(candidate, exc, rel)
    return files, ranges, problems


def _check_share(candidate: Path, manifest: Manifest, share, found: list[str]) -> list[str]:
    """`found`, the damage found so far, and the damage in this rank's share (`_shares`) of what
    nobody reads, one line each."""
    whole, blocks = share
    _prefetch(candidate, manifest, whole, {}, blocks)
    problems = list(found)
    for rel in whole:
        try:
            check_file_content(candidate, rel, manifest, keep=False)
        except DAMAGE as exc:
            problems += _damage_lines(candidate, exc, rel)
    for rel, numbers in sorted(blocks.items()):
        try:
            partial_reads.check_blocks(candidate / rel, manifest.files[rel], numbers)
        except DAMAGE as exc:
            problems += _damage_lines(candidate, exc, rel)
    return problems


def _damage_lines(candidate: Path, exc: BaseException, rel: str) -> list[str]:
    """What a `DAMAGE` exception about `rel` says, one line per problem, each naming its file."""
    return [f"{candidate / p.file}: {p.reason}" for p in damage_problems(exc, rel)]


def _prefetch(candidate: Path, manifest: Manifest, whole: list[str], ranges: dict, share: dict) -> None:
    """Hint the kernel at every byte `_read_share` reads on this rank, in its order.

    The disk then reads ahead while earlier bytes are checked. Nothing is read or trusted here, and
    nothing fails: the reads after it meet and report whatever would.
    """
    try:
        _hint_reads(candidate, manifest.files, whole, ranges, share)
    except DAMAGE:  # a hint: the verified reads that follow report every problem
        pass


def _hint_reads(candidate: Path, listed: dict, whole: list[str], ranges: dict, share: dict) -> None:
    for rel in whole:
        if rel in listed:
            read_ahead.prefetch(candidate / rel, listed[rel])
    for rel, items in sorted(ranges.items()):
        index = listed[rel].blocks if rel in listed and rel not in whole else None
        if index is not None:
            spans = [(0, index.data_start)] + [partial_reads.byte_range(index, tuple(item)) for item in items]
            read_ahead.prefetch(candidate / rel, listed[rel], spans)
    for rel, blocks in sorted(share.items()):
        block_bytes = listed[rel].blocks.block_bytes
        read_ahead.prefetch(candidate / rel, listed[rel], [(b * block_bytes, (b + 1) * block_bytes) for b in blocks])


def _unread_blocks(index, rel: str, plans: list[dict]) -> list[int]:
    """The blocks of a partially read file that no rank's ranges touch, the header's aside."""
    read = bytearray(len(index.digests))
    for plan in plans:
        if rel in plan["ranges"]:
            for i in index.blocks_for(0, index.data_start):
                read[i] = 1
            partial_reads.mark_blocks(index, plan["ranges"][rel], read)
    return [i for i, touched in enumerate(read) if not touched]


def _cut(checked: checked_reads.CheckedFile, wanted: list) -> dict:
    tensors = checked.tensors()
    return {item: _cut_one(tensors, item) for item in wanted}


def _cut_one(tensors: dict, wanted: partial_reads.ElementRange):
    """Element range `wanted` of a file read whole: a view, or a strided range's rows, compact."""
    name, first, stop = wanted[:3]
    tensor = tensors.get(name)
    if tensor is None:
        raise GenerationDamaged(f"tensor {name!r} is not in the file (it holds {sorted(tensors)[:8]})")
    if not 0 <= first <= stop <= tensor.numel():
        raise GenerationDamaged(f"tensor {name!r} holds {tensor.numel()} elements, not [{first}, {stop})")
    return partial_reads.cut_range(tensor.reshape(-1)[first:stop], wanted)
