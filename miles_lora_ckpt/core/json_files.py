"""JSON files in the plugin's own form: written atomically, read verified and parsed strictly.

`json_bytes` is the one written form (sorted keys, indent 1, no NaN); `write_json` writes it
crash-safely; `read_json` reads a file whole (size, digest) and `parse_json` parses it with
`bounded`'s limits, a refusal being damage of that file (`GenerationDamaged`).
"""

from __future__ import annotations

import json
from pathlib import Path

from miles_lora_ckpt.core import atomic_files, bounded
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.file_reader import read_file_verified
from miles_lora_ckpt.core.layout import FileRecord

__all__ = ["json_bytes", "parse_json", "read_json", "write_json"]


def json_bytes(obj) -> bytes:
    """`obj` in the plugin's JSON form: sorted keys, indent 1, NaN and Infinity refused."""
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()


def write_json(path: Path, obj) -> FileRecord:
    """Write `json_bytes(obj)` to `path` crash-safely (`write_file_atomic`)."""
    return atomic_files.write_file_atomic(path, [json_bytes(obj)])


def parse_json(raw: bytes | bytearray, *, what: str = "JSON"):
    """Parse `raw` as strict, bounded JSON (`bounded.parse_json`); refusal: GenerationDamaged."""
    try:
        return bounded.parse_json(raw, what=what)
    except ValueError as exc:  # bounded refuses bad bytes with ValueError, and raises nothing else
        raise GenerationDamaged(str(exc)) from None


def read_json(path: Path, record: FileRecord | None = None, *, max_bytes: int = bounded.MAX_JSON_BYTES):
    """Read a JSON file whole and parse it; returns the parsed value.

    The bytes are checked against `record` when given and may be at most `max_bytes`. A refusal of
    the bytes is GenerationDamaged; an OSError of the read propagates.
    """
    return parse_json(read_file_verified(path, record, max_bytes=max_bytes), what=Path(path).name)
