"""The crash-safe checkpoint protocol every saver and loader goes through.

Save, read top to bottom as phases::

    prepare   coordinator picks a fresh attempt id, makes `.staging-<id>`     -> agree
    write     every rank writes its own files into the staging directory      -> agree (gathers file records)
    commit    coordinator writes manifest.json last, inside the staging dir   -> agree
    publish   coordinator renames staging to gen-<iter>-<id> (one atomic
              rename), then replaces the tracker                              -> agree
    retain    coordinator prunes old generations (never raises: it runs after the last collective)

Load: the coordinator lists candidate generations; for each, every rank reads (and digest-checks)
the files it needs and the files nobody needs are checked round-robin; all ranks agree on the
verdict; a damaged newest generation of a root is skipped with a warning. Nothing is mutated here:
callers get verified bytes and do their own preflight before touching model or optimizer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from miles_lora_ckpt.core import faults, retention, storage
from miles_lora_ckpt.core.consensus import Consensus, Outcome, attempt
from miles_lora_ckpt.core.errors import CheckpointError, RankFailure
from miles_lora_ckpt.core.layout import (
    MANIFEST,
    TRACKER,
    FileRecord,
    Manifest,
    Topology,
    generation_dir_name,
    new_attempt_id,
    staging_dir_name,
)
from miles_lora_ckpt.core.verify import Generation, check_file_content, check_structure, committed_candidates

log = logging.getLogger(__name__)


class StagingWriter:
    """What one rank may do during the write phase: put files into the attempt's staging directory."""

    def __init__(self, staging: Path, rank: int):
        self.staging = staging
        self.rank = rank
        self.records: dict[str, FileRecord] = {}

    def write_tensors(self, relpath: str, tensors, *, metadata: dict[str, str] | None = None, finite: bool = True):
        self._record(relpath, storage.save_tensors(self._target(relpath), tensors, metadata=metadata, finite=finite))

    def write_json(self, relpath: str, obj) -> None:
        self._record(relpath, storage.write_json(self._target(relpath), obj))

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
        for directory in sorted({(self.staging / rel).parent for rel in self.records}, reverse=True):
            storage.fsync_dir(directory)


WriteFn = Callable[[StagingWriter], None]


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
) -> Path:
    """Collective. Write one generation of `root` through all phases; returns its directory.

    `write_files(writer)` runs on every rank and writes that rank's files (possibly none).
    `metadata` (JSON) goes into the manifest; `keep` prunes to the newest N generations afterwards.
    Raises the same CheckpointError on every rank if any rank fails any phase; the previous
    generation and the tracker are then untouched.
    """
    root, rank = Path(root), consensus.rank
    coordinator = rank == 0

    # prepare: the coordinator picks a fresh attempt id and makes its staging directory
    prepared = attempt(_make_staging, root) if coordinator else Outcome.success()
    attempt_id = consensus.agree("prepare", prepared)[0]
    staging = root / staging_dir_name(attempt_id)

    # write: each rank its own files
    records_by_rank = consensus.agree("write", attempt(_write_rank_files, staging, rank, write_files))

    # commit: the coordinator writes the manifest last, still inside the staging directory
    manifest = Manifest(
        generation=attempt_id,
        iteration=iteration,
        saver=saver,
        topology=topology,
        files={},
        metadata=metadata or {},
    )
    commit = _write_manifest if coordinator else _bystander(COMMIT_FAULTS)
    consensus.agree("commit", attempt(commit, staging, manifest, records_by_rank, rank))

    # publish: one atomic rename makes the generation visible, then the tracker names it
    final = root / generation_dir_name(iteration, attempt_id)
    publish = _publish if coordinator else _bystander(PUBLISH_FAULTS)
    consensus.agree("publish", attempt(publish, staging, final, manifest, rank))

    # retain: after the last collective, so it must not raise
    if coordinator and keep is not None:
        retention.prune_quietly(root, keep=keep)
    return final


def _make_staging(root: Path) -> str:
    # No fsync here: a staging directory lost in a crash is just an attempt that never happened.
    attempt_id = new_attempt_id()
    root.mkdir(parents=True, exist_ok=True)
    (root / staging_dir_name(attempt_id)).mkdir()  # fails if it exists: never reused
    return attempt_id


def _write_rank_files(staging: Path, rank: int, write_files: WriteFn) -> dict:
    faults.point("before-write", rank)
    writer = StagingWriter(staging, rank)
    write_files(writer)
    if not writer.records:
        faults.point("mid-write", rank)  # a rank with nothing to write still passes every phase
    writer.sync_dirs()
    faults.point("after-write", rank)
    return {rel: rec.to_dict() for rel, rec in writer.records.items()}


COMMIT_FAULTS = ("after-consensus", "mid-manifest", "before-publish")
PUBLISH_FAULTS = ("after-publish",)


def _bystander(phases: tuple[str, ...]):
    """Non-coordinators do no commit or publish work, but every fault phase can fire on every rank."""

    def run(*args) -> None:
        for phase in phases:
            faults.point(phase, args[-1])

    return run


def _write_manifest(staging: Path, manifest: Manifest, records_by_rank: list[dict], rank: int) -> None:
    faults.point("after-consensus", rank)
    manifest.files = _merge_records(records_by_rank)
    body = manifest.to_json_bytes()
    half = len(body) // 2

    def manifest_chunks():
        yield body[:half]
        faults.point("mid-manifest", rank)
        yield body[half:]

    storage.write_file_atomic(staging / MANIFEST, manifest_chunks())
    storage.fsync_dir(staging)
    faults.point("before-publish", rank)


def _publish(staging: Path, final: Path, manifest: Manifest, rank: int) -> None:
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    os.rename(staging, final)
    tracker = {"generation_dir": final.name, "generation": manifest.generation, "iteration": manifest.iteration}
    storage.write_json(final.parent / TRACKER, tracker)
    storage.fsync_dir(final.parent)  # makes the rename and the tracker durable together
    faults.point("after-publish", rank)


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
    """A generation all ranks agreed on, with this rank's files read and verified."""

    path: Path
    manifest: Manifest
    buffers: dict[str, bytearray]

    def tensors(self, relpath: str):
        """Zero-copy tensors of one of this rank's files (already digest- and header-checked)."""
        _, entries = storage.parse_safetensors_header(self.buffers[relpath])
        return storage.tensors_from_buffer(self.buffers[relpath], entries)

    def json(self, relpath: str):
        return storage.parse_json(self.buffers[relpath])


FilesFn = Callable[[Manifest], list[str]]


def open_generation(consensus: Consensus, path: str | os.PathLike, files_for_rank: FilesFn) -> OpenedGeneration:
    """Collective. Resolve `path` (a save root or one generation) and read this rank's files.

    Every rank reads `files_for_rank(manifest)` with size, digest and header checks; the files no
    rank asked for are verified round-robin, so every listed byte is checked exactly once. All
    ranks agree on one generation; a root falls back past damaged generations with a warning, an
    explicit generation that is damaged fails. Mutates nothing.
    """
    rank, world = consensus.rank, consensus.world_size
    # resolve: every rank must ask for the same thing; the coordinator lists candidates, newest first
    consensus.agree_same("resolve", Outcome.success(str(path)))
    listing = attempt(_list_candidates, Path(path)) if rank == 0 else Outcome.success()
    candidates, is_root = consensus.agree("resolve", listing)[0]
    damage: list[RankFailure] = []
    for candidate in map(Path, candidates):
        # plan: every rank checks the structure (once) and names the files it needs
        planned = attempt(_plan_reads, candidate, files_for_rank)
        plans = consensus.agree("resolve", planned.map(lambda p: p[1]))
        problems = [RankFailure(r, p) for r, plan in enumerate(plans) for p in plan["problems"]]
        if not problems:
            # read: own files plus a share of the unclaimed ones; agree on what was found
            # (damage found in a file is a verdict; any other error fails the load on every rank)
            manifest = planned.value[0].manifest
            local = attempt(_read_share, rank, world, candidate, manifest, [plan["files"] for plan in plans])
            verdicts = consensus.agree("read", local.map(lambda read: read[1]))
            problems = [RankFailure(r, p) for r, v in enumerate(verdicts) for p in v]
            if not problems:
                return OpenedGeneration(candidate, manifest, local.value[0])
        damage += problems
        if not is_root:
            break
        log.warning("skipping damaged generation %s: %s", candidate, "; ".join(f.error for f in problems))
    raise CheckpointError("verify", damage or [RankFailure(0, f"no intact generation under {path}")])


def _list_candidates(path: Path) -> tuple[list[str], bool]:
    candidates, is_root = committed_candidates(path)
    return [str(c) for c in candidates], is_root


def _plan_reads(candidate: Path, files_for_rank: FilesFn) -> tuple[Generation, dict]:
    """The checked structure (kept on this rank) and the JSON plan every rank agrees on."""
    gen = check_structure(candidate)
    if not gen.intact:
        return gen, {"files": [], "problems": [f"{candidate / p.file}: {p.reason}" for p in gen.problems]}
    wanted = sorted(files_for_rank(gen.manifest))
    missing = [
        f"{candidate / rel}: required by the loader but not in the manifest (torn or foreign generation)"
        for rel in wanted
        if rel not in gen.manifest.files
    ]
    return gen, {"files": wanted, "problems": missing}


def _read_share(rank: int, world: int, candidate: Path, manifest: Manifest, wanted: list[list[str]]):
    """Read this rank's files and its round-robin share of the unclaimed ones."""
    faults.point("before-read", rank)
    unclaimed = sorted(set(manifest.files) - {rel for files in wanted for rel in files})
    buffers, problems = {}, []
    for rel in list(wanted[rank]) + unclaimed[rank::world]:
        try:
            buffers[rel] = check_file_content(candidate, rel, manifest.files[rel])
        except (OSError, ValueError) as exc:
            problems.append(f"{candidate / rel}: {exc}")
    return {rel: buffers[rel] for rel in wanted[rank] if rel in buffers}, problems
