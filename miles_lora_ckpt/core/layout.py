"""On-disk layout of a save root, and the manifest that makes a generation committed.

A save root holds (docs/file-format.md has the whole layout)::

    <root>/
      latest_generation.json             tracker: the newest committed generation
      .writer-lease.json                 the writer lease (`lease`)
      gen-000000010-3f2a9c1e0b7d4e55/    a committed generation, published by one rename
        manifest.json                    written last; every other file's size and digest
      .staging-7c0d1e2f3a4b5c6d/         an attempt in progress, or a crashed one's leftover
      .deleting-gen-.../                 a generation being removed by retention
      latest, step_10 -> gen-...         optional generation links, swapped by the publish

A staging name starts with a dot and matches neither `gen-*` nor Miles' `iter_NNNNNNN`, so no reader
takes it for a checkpoint. A generation is committed when named `gen-*` with a manifest whose
self-digest checks. It is intact when every listed file is present with its size and digest, and
nothing else is there.

The manifest is read through a table of fields (`FIELDS`), each with its bounded reader, its writer
and the first format version that has it. To add a field, give `Manifest` an attribute with a
default and add one `ManifestField` line (`optional=True` if older generations lack it).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from miles_lora_ckpt.core import bounded, signing
from miles_lora_ckpt.core.digest import digest_bytes
from miles_lora_ckpt.core.errors import GenerationDamaged

__all__ = [
    "DELETING_PREFIX",
    "GENERATION_PREFIX",
    "LATEST",
    "LEASE",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MAX_SEQUENCE",
    "MAX_TRACKER_BYTES",
    "ROLE_TRAINING_STATE",
    "STAGING_PREFIX",
    "STAMP_KEYS",
    "TRACKER",
    "BlockIndex",
    "FileRecord",
    "Manifest",
    "Topology",
    "Tracker",
    "canonical_json",
    "generation_dir_name",
    "is_staging_dir_name",
    "new_attempt_id",
    "parse_generation_dir_name",
    "seal_manifest",
    "staging_dir_name",
]

FORMAT_NAME = "miles-lora-ckpt"
# v3: the single-LoRA saver records where every saved tensor lies in the global model (metadata
# `global_layout`, optimizer `layout.positions`), so such a generation may be resharded.
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
TRACKER = "latest_generation.json"
LATEST = "latest"  # optional symlink to the newest published generation (replaced atomically)
LEASE = ".writer-lease.json"
GENERATION_PREFIX = "gen-"
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"

MAX_MANIFEST_BYTES = bounded.MAX_JSON_BYTES
MAX_TRACKER_BYTES = 64 * 1024
MAX_ITERATION = 10**18 - 1  # a generation directory name holds at most 18 digits
MAX_SEQUENCE = 2**62
MAX_FILE_BYTES = 2**62
MAX_TOPOLOGY_SIZE = 2**24

# Names and numbers on disk are ASCII only: `[0-9]`, never `\d`, which takes any Unicode digit that
# int() reads. Matched whole with `\Z`, since `$` also matches before a trailing newline.
ATTEMPT_ID = re.compile(r"[0-9a-f]{16}", re.ASCII)  # matched whole (fullmatch)
DIGEST = re.compile(r"xxh3_128:[0-9a-f]{32}", re.ASCII)
_GENERATION_RE = re.compile(r"gen-([0-9]{9,18})-([0-9a-f]{16})\Z", re.ASCII)
_STAGING_RE = re.compile(r"\.staging-([0-9a-f]{16})\Z", re.ASCII)

# What a tensor file's own safetensors metadata says about itself (format v2): the generation it
# was written for, and its path inside that generation.
STAMP_KEYS = ("generation", "file")
ROLE_TRAINING_STATE = "training-state"
# Format v1 records no roles; these files of known savers are given theirs when read.
_V1_ROLES = {("single-lora", "training_state.json"): ROLE_TRAINING_STATE}


def new_attempt_id() -> str:
    """A fresh, unguessable attempt id (16 hex digits); chosen on one rank and broadcast."""
    return secrets.token_hex(8)


def generation_dir_name(iteration: int, attempt_id: str) -> str:
    """The directory name of the generation of `iteration` written by attempt `attempt_id`."""
    return f"{GENERATION_PREFIX}{iteration:09d}-{attempt_id}"


def staging_dir_name(attempt_id: str) -> str:
    """The staging directory name of attempt `attempt_id`."""
    return f"{STAGING_PREFIX}{attempt_id}"


def parse_generation_dir_name(name: str) -> tuple[int, str] | None:
    """`(iteration, attempt_id)` for a committed-generation name, else None."""
    match = _GENERATION_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def is_staging_dir_name(name: str) -> bool:
    """Whether `name` is a staging directory's name."""
    return _STAGING_RE.match(name) is not None


@dataclass(frozen=True)
class Topology:
    """The parallel layout a generation was written with."""

    world: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1

    def to_dict(self) -> dict[str, int]:
        """The topology as the manifest's `topology` object."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "topology") -> Topology:
        """The topology of a manifest's `topology` object; ValueError naming `where` if bad."""
        names = {f.name for f in fields(cls)}
        bounded.mapping(data, where)
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown topology keys {bounded.names(sorted(unknown))}")
        for key, value in data.items():
            bounded.integer(value, f"{where} {key}", low=1, high=MAX_TOPOLOGY_SIZE)
        return cls(**data)

    def model_parallel_differences(self, other: Topology) -> list[str]:
        """Axes besides DP and world whose sizes differ, e.g. ``"cp: 2 -> 1 (context parallel)"``.

        Each forbids an exact restore, since it changes which adapter shards and optimizer buckets
        a rank holds. ``cp`` and ``vpp`` count; a DP-size change alone is allowed.
        """
        return [
            f"{axis}: {getattr(self, axis)} -> {getattr(other, axis)} ({meaning})"
            for axis, meaning in MODEL_PARALLEL_AXES.items()
            if getattr(self, axis) != getattr(other, axis)
        ]


MODEL_PARALLEL_AXES = {
    "tp": "tensor parallel",
    "pp": "pipeline stages",
    "ep": "expert parallel",
    "etp": "expert tensor parallel",
    "cp": "context parallel",
    "vpp": "virtual pipeline chunks",
}


MIN_BLOCK_BYTES = 64
MAX_BLOCK_BYTES = 2**30
_DTYPE_TAGS = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")


@dataclass(frozen=True)
class BlockIndex:
    """Per-block digests of a tensor file, so that a reader may verify exactly the bytes it reads.

    The file is cut into blocks of `block_bytes` from offset 0, the last one shorter; `digests[i]`
    is block i's digest. `tensors` maps each tensor to `(dtype tag, begin, end)`, its absolute byte
    range, which readers check against the header. So the manifest alone names the blocks of any
    element range.
    """

    block_bytes: int
    digests: tuple[str, ...]
    tensors: dict[str, tuple[str, int, int]]

    def blocks_for(self, begin: int, end: int) -> range:
        """The indices of the blocks that hold bytes `[begin, end)`; empty for an empty range."""
        if end <= begin:
            return range(0)
        return range(begin // self.block_bytes, (end - 1) // self.block_bytes + 1)

    @property
    def data_start(self) -> int:
        """Where the first tensor's bytes begin; the header lies before it."""
        return min((begin for _, begin, _ in self.tensors.values()), default=0)

    def to_dict(self) -> dict:
        """The index as a file record's `blocks` object."""
        return {
            "bytes": self.block_bytes,
            "digests": list(self.digests),
            "tensors": {name: list(span) for name, span in sorted(self.tensors.items())},
        }

    @classmethod
    def from_dict(cls, data: Any, where: str, size: int) -> BlockIndex:
        """The index of a `blocks` object for a file of `size` bytes; ValueError naming `where`."""
        bounded.mapping(data, where)
        if set(data) != {"bytes", "digests", "tensors"}:
            raise ValueError(f"{where} has keys {bounded.names(sorted(data))}, expected bytes, digests, tensors")
        block = bounded.integer(data["bytes"], f"{where} bytes", low=MIN_BLOCK_BYTES, high=MAX_BLOCK_BYTES)
        if block % 8:
            raise ValueError(f"{where} bytes is {block}, not a multiple of 8")
        digests = data["digests"]
        if not isinstance(digests, list) or len(digests) != -(-size // block):
            raise ValueError(f"{where} digests: expected {-(-size // block)} for {size} bytes in blocks of {block}")
        digests = tuple(bounded.string(d, f"{where} digest", pattern=DIGEST) for d in digests)
        bounded.mapping(data["tensors"], f"{where} tensors")
        tensors = {}
        for name, span in data["tensors"].items():
            here = f"{where} tensor {bounded.string(name, f'{where} tensor name', max_len=1024)[:80]!r}"
            if not (isinstance(span, list) and len(span) == 3 and span[0] in _DTYPE_TAGS):
                raise ValueError(f"{here}: expected [dtype, begin, end], got {bounded.show(span)}")
            begin = bounded.integer(span[1], f"{here} begin", high=size)
            end = bounded.integer(span[2], f"{here} end", low=begin, high=size)
            tensors[name] = (span[0], begin, end)
        return cls(block, digests, tensors)


@dataclass(frozen=True)
class FileRecord:
    """Size and digest of one written file, as the manifest lists it.

    `binding` (format v2) says what the file is, such as
    `{"role": "optimizer", "coordinate": "tp000_pp000_ep000_etp000", "child": "1"}`. A tensor file
    carries the same keys in its own metadata, and readers check both agree. `blocks` (format v2,
    optional) holds the `BlockIndex` of a file written for partial reads.
    """

    bytes: int
    digest: str
    finite: bool = False  # the writer checked that every float tensor in it is finite
    binding: dict[str, str] = field(default_factory=dict)
    blocks: BlockIndex | None = None

    def to_dict(self) -> dict:
        """The record as the manifest's `files` entry."""
        record: dict = {"bytes": self.bytes, "digest": self.digest}
        if self.finite:
            record["finite"] = True
        if self.binding:
            record["binding"] = dict(sorted(self.binding.items()))
        if self.blocks is not None:
            record["blocks"] = self.blocks.to_dict()
        return record

    @classmethod
    def from_dict(cls, data: Any, where: str = "file record") -> FileRecord:
        """The record of a manifest's `files` entry; ValueError naming `where` if malformed."""
        bounded.mapping(data, where)
        unknown = set(data) - {"bytes", "digest", "finite", "binding", "blocks"}
        if unknown or not {"bytes", "digest"} <= set(data):
            raise ValueError(
                f"{where} has keys {bounded.names(sorted(data))}, expected bytes, digest[, finite, binding, blocks]"
            )
        finite = data.get("finite", False)
        if not isinstance(finite, bool):
            raise ValueError(f"{where} finite is {bounded.show(finite)}, not a boolean")
        size = bounded.integer(data["bytes"], f"{where} bytes", high=MAX_FILE_BYTES)
        return cls(
            bytes=size,
            digest=bounded.string(data["digest"], f"{where} digest", pattern=DIGEST),
            finite=finite,
            binding=bounded.string_map(data.get("binding", {}), f"{where} binding", max_len=256),
            blocks=BlockIndex.from_dict(data["blocks"], f"{where} blocks", size) if "blocks" in data else None,
        )


def _read_files(data: Any, where: str) -> dict[str, FileRecord]:
    bounded.mapping(data, where)
    return {
        bounded.string(rel, f"{where} path", max_len=1024): FileRecord.from_dict(rec, f"{where}[{rel[:80]!r}]")
        for rel, rec in data.items()
    }


def _write_files(files: dict[str, FileRecord]) -> dict:
    return {name: rec.to_dict() for name, rec in sorted(files.items())}


@dataclass(frozen=True)
class ManifestField:
    """One top-level field of the manifest: how it is read and checked, written, and since when.

    An `optional` field may be absent: the `Manifest` attribute's default is used, and None is not
    written. Every other field of the manifest's version must be present.
    """

    name: str
    read: Callable[[Any, str], Any]
    write: Callable[[Any], Any] = lambda value: value
    since: int = 1
    optional: bool = False


FIELDS: tuple[ManifestField, ...] = (
    ManifestField("generation", lambda v, w: bounded.string(v, w, pattern=ATTEMPT_ID)),
    ManifestField("iteration", lambda v, w: bounded.integer(v, w, high=MAX_ITERATION)),
    ManifestField("sequence", lambda v, w: bounded.integer(v, w, low=1, high=MAX_SEQUENCE), since=2),
    ManifestField("saver", lambda v, w: bounded.string(v, w, max_len=128)),
    ManifestField("created_unix_ns", lambda v, w: bounded.integer(v, w)),
    ManifestField("topology", Topology.from_dict, Topology.to_dict),
    ManifestField("files", _read_files, _write_files),
    ManifestField("metadata", bounded.mapping),
)


@dataclass
class Manifest:
    """Everything a reader needs to trust a generation; `manifest.json` is written last.

    `sequence` (format v2) is the generation's place in its root's commit order, set at prepare;
    format v1 has None. `signature` is the optional keyed seal (`signing`). `sealed_body` holds
    the canonical bytes that the digest and signature cover, and `sealed_digest` that digest, as
    read and checked (both empty on a manifest not read from bytes).
    """

    generation: str
    iteration: int
    saver: str
    topology: Topology
    files: dict[str, FileRecord]
    metadata: dict = field(default_factory=dict)
    sequence: int | None = None
    created_unix_ns: int = field(default_factory=time.time_ns)
    format_version: int = FORMAT_VERSION
    signature: dict | None = field(default=None, compare=False)
    sealed_body: bytes = field(default=b"", compare=False, repr=False)
    sealed_digest: str = field(default="", compare=False, repr=False)

    def to_json_bytes(self, key: signing.SigningKey | None = None) -> bytes:
        """The sealed manifest: body, its self-digest and, with a key, its HMAC signature."""
        return seal_manifest(self._body(), key)

    def _body(self) -> dict:
        body: dict = {"format": FORMAT_NAME, "format_version": self.format_version}
        for spec in FIELDS:
            value = getattr(self, spec.name)
            if self.format_version >= spec.since and not (spec.optional and value is None):
                body[spec.name] = spec.write(value)
        return body

    def role_of(self, relpath: str) -> str | None:
        """The role listed file `relpath` plays (`binding["role"]`), or None.

        Format v1 records no roles; known savers' files are given theirs.
        """
        record = self.files.get(relpath)
        if record is not None and "role" in record.binding:
            return record.binding["role"]
        return _V1_ROLES.get((self.saver, relpath)) if self.format_version == 1 else None

    @classmethod
    def from_json_bytes(cls, raw: bytes | bytearray) -> Manifest:
        """The manifest of the bytes `raw`: parsed bounded, its self-digest and every field checked.

        Raises GenerationDamaged naming what is wrong. The signature, if any, is kept for
        `signing.problem`.
        """
        try:
            return cls._parse(raw)
        except ValueError as exc:  # every refusal of the manifest's bytes is damage
            raise GenerationDamaged(str(exc)) from None

    @classmethod
    def _parse(cls, raw: bytes | bytearray) -> Manifest:
        body = bounded.mapping(bounded.parse_json(raw, what="manifest", max_bytes=MAX_MANIFEST_BYTES), "manifest")
        claimed = body.pop("manifest_digest", None)
        signature = body.pop("signature", None)
        if claimed is None:
            raise ValueError("no manifest_digest")
        canonical = canonical_json(body)
        if digest_bytes(canonical) != claimed:
            raise ValueError("manifest self-digest mismatch (edited or corrupted)")
        if body.get("format") != FORMAT_NAME:
            raise ValueError(f"format is {bounded.show(body.get('format'))}, expected {FORMAT_NAME!r}")
        version = body.get("format_version")
        if type(version) is not int or version not in READABLE_FORMAT_VERSIONS:  # not 2.0, not True
            raise ValueError(
                f"unsupported format_version {bounded.show(version)} (this version reads {list(READABLE_FORMAT_VERSIONS)})"
            )
        known = {spec.name: spec for spec in FIELDS if version >= spec.since}
        missing = sorted(name for name, spec in known.items() if name not in body and not spec.optional)
        unknown = sorted(set(body) - set(known) - {"format", "format_version"})
        if missing or unknown:
            raise ValueError(
                f"format v{version} manifest: missing fields {missing}, unknown fields {bounded.names(unknown)}"
            )
        values = {name: spec.read(body[name], f"manifest field {name}") for name, spec in known.items() if name in body}
        if signature is not None:
            signing.check_shape(signature)
        return cls(**values, format_version=version, signature=signature, sealed_body=canonical, sealed_digest=claimed)


def canonical_json(body: dict) -> bytes:
    """The canonical bytes of a manifest body: what its digest and signature cover."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal_manifest(body: dict, key: signing.SigningKey | None = None) -> bytes:
    """The bytes of `manifest.json` for `body`: the body, its self-digest and, with `key`, a MAC."""
    canonical = canonical_json(body)
    sealed = dict(body, manifest_digest=digest_bytes(canonical))
    if key is not None:
        sealed["signature"] = signing.sign(canonical, key)
    return json.dumps(sealed, indent=1, sort_keys=True).encode()


# --------------------------------------------------------------------------- tracker


@dataclass(frozen=True)
class Tracker:
    """`latest_generation.json`: the generation the last publish named (a hint, cross-checked)."""

    generation_dir: str
    generation: str
    iteration: int
    sequence: int | None = None  # format v2

    def to_dict(self) -> dict:
        """The tracker as `latest_generation.json` holds it."""
        data = {"generation_dir": self.generation_dir, "generation": self.generation, "iteration": self.iteration}
        if self.sequence is not None:
            data["sequence"] = self.sequence
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Tracker:
        """The tracker a root holds; GenerationDamaged naming what is wrong."""
        try:
            return cls._parse(data)
        except ValueError as exc:  # every refusal of the tracker file's content is damage
            raise GenerationDamaged(str(exc)) from None

    @classmethod
    def _parse(cls, data: Any) -> Tracker:
        bounded.mapping(data, "tracker")
        name = bounded.string(data.get("generation_dir"), "tracker generation_dir", max_len=64)
        if parse_generation_dir_name(name) is None:
            raise ValueError(f"tracker generation_dir {bounded.show(name)} is not a generation directory name")
        sequence = data.get("sequence")
        return cls(
            generation_dir=name,
            generation=bounded.string(data.get("generation"), "tracker generation", pattern=ATTEMPT_ID),
            iteration=bounded.integer(data.get("iteration"), "tracker iteration", high=MAX_ITERATION),
            sequence=None
            if sequence is None
            else bounded.integer(sequence, "tracker sequence", low=1, high=MAX_SEQUENCE),
        )
