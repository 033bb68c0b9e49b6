"""On-disk layout of a save root, and the manifest that makes a generation committed.

A save root holds::

    <root>/
      latest_generation.json             tracker: names the newest committed generation (atomic replace)
      gen-000000010-3f2a9c1e0b7d4e55/    a committed generation (published by one atomic rename)
        manifest.json                    written last; lists every other file with size and digest
        ...                              the saver's files (safetensors tensors, JSON metadata)
      .staging-7c0d1e2f3a4b5c6d/         an attempt in progress, or abandoned by a crash

A staging name starts with a dot and never matches `gen-*` nor Miles' `iter_NNNNNNN`, so no reader
(ours or Miles') can take it for a checkpoint. A generation directory is committed when it is named
`gen-*` and holds a manifest whose self-digest checks; it is intact when every file it lists is
present with its size and digest and nothing else is there.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, fields

from miles_lora_ckpt.core.digest import digest_bytes

FORMAT_NAME = "miles-lora-ckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRACKER = "latest_generation.json"
GENERATION_PREFIX = "gen-"
STAGING_PREFIX = ".staging-"

_GENERATION_RE = re.compile(r"^gen-(\d{9})-([0-9a-f]{16})$")
_STAGING_RE = re.compile(r"^\.staging-([0-9a-f]{16})$")


def new_attempt_id() -> str:
    """A fresh, unguessable attempt id (16 hex digits); chosen on one rank and broadcast."""
    return secrets.token_hex(8)


def generation_dir_name(iteration: int, attempt_id: str) -> str:
    return f"{GENERATION_PREFIX}{iteration:09d}-{attempt_id}"


def staging_dir_name(attempt_id: str) -> str:
    return f"{STAGING_PREFIX}{attempt_id}"


def parse_generation_dir_name(name: str) -> tuple[int, str] | None:
    """`(iteration, attempt_id)` for a committed-generation name, else None."""
    match = _GENERATION_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def is_staging_dir_name(name: str) -> bool:
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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown topology keys {sorted(unknown)}")
        for key, value in data.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"topology {key}={value!r} is not a positive integer")
        return cls(**data)

    def model_parallel_differences(self, other: Topology) -> list[str]:
        """Axes other than DP (and world) whose sizes differ, e.g. ``"cp: 2 -> 1 (context parallel)"``.

        Each forbids an exact restore: they change which adapter shards and optimizer buckets a
        rank holds (``cp`` and ``vpp`` included: a DP-size change alone is allowed).
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


@dataclass(frozen=True)
class FileRecord:
    """Size and digest of one written file, as the manifest lists it."""

    bytes: int
    digest: str
    finite: bool = False  # every float tensor in it must be finite (checked by verify)

    def to_dict(self) -> dict:
        record = {"bytes": self.bytes, "digest": self.digest}
        if self.finite:
            record["finite"] = True
        return record

    @classmethod
    def from_dict(cls, data: dict) -> FileRecord:
        if not isinstance(data.get("bytes"), int) or not isinstance(data.get("digest"), str):
            raise ValueError(f"bad file record {data!r}")
        return cls(bytes=data["bytes"], digest=data["digest"], finite=bool(data.get("finite", False)))


@dataclass
class Manifest:
    """Everything a reader needs to trust a generation; `manifest.json` is written last."""

    generation: str
    iteration: int
    saver: str
    topology: Topology
    files: dict[str, FileRecord]
    metadata: dict = field(default_factory=dict)
    created_unix_ns: int = field(default_factory=time.time_ns)
    format_version: int = FORMAT_VERSION

    def to_json_bytes(self) -> bytes:
        return seal_manifest(self._body())

    def _body(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "generation": self.generation,
            "iteration": self.iteration,
            "saver": self.saver,
            "created_unix_ns": self.created_unix_ns,
            "topology": self.topology.to_dict(),
            "files": {name: rec.to_dict() for name, rec in sorted(self.files.items())},
            "metadata": self.metadata,
        }

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> Manifest:
        """Parse and check the self-digest; raises ValueError with the reason."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        claimed = body.pop("manifest_digest", None)
        if claimed is None:
            raise ValueError("no manifest_digest")
        if manifest_digest(body) != claimed:
            raise ValueError("manifest self-digest mismatch (edited or corrupted)")
        if body.get("format") != FORMAT_NAME:
            raise ValueError(f"format is {body.get('format')!r}, expected {FORMAT_NAME!r}")
        if body.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {body.get('format_version')!r}")
        try:
            return cls(
                generation=str(body["generation"]),
                iteration=int(body["iteration"]),
                saver=str(body["saver"]),
                topology=Topology.from_dict(body["topology"]),
                files={name: FileRecord.from_dict(rec) for name, rec in body["files"].items()},
                metadata=dict(body["metadata"]),
                created_unix_ns=int(body["created_unix_ns"]),
                format_version=body["format_version"],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed manifest field ({exc!r})") from None


def manifest_digest(body: dict) -> str:
    """Digest of a manifest body (without its `manifest_digest` key), over canonical JSON."""
    return digest_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def seal_manifest(body: dict) -> bytes:
    """The bytes of `manifest.json` for `body`: the body plus its self-digest."""
    sealed = dict(body, manifest_digest=manifest_digest(body))
    return json.dumps(sealed, indent=1, sort_keys=True).encode()
