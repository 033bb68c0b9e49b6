"""Crash-safe files: written under a temporary name, fsynced, then renamed; directories fsynced.

`write_file_atomic` hashes the bytes as they are written (and feeds per-block digests when asked),
while a `WriteBehind` thread writes them, so a file's digest costs almost nothing on top of its I/O.
`fsync_dir` makes the renames and creations inside a directory durable.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from miles_lora_ckpt.core.digest import BlockDigests, StreamingDigest
from miles_lora_ckpt.core.layout import FileRecord
from miles_lora_ckpt.core.write_behind import WriteBehind

__all__ = ["fsync_dir", "write_file_atomic"]


def write_file_atomic(
    path: Path, chunks: Iterable[bytes | memoryview], *, blocks: BlockDigests | None = None
) -> FileRecord:
    """Write `chunks` to `path` via a temporary name, fsync and rename.

    Returns the file's `FileRecord` (size and digest); an OSError of the writes propagates, and the
    temporary file is removed. The writes run on a `WriteBehind` thread while this thread hashes the
    next chunk; both release the GIL, so the digest costs almost nothing on top of the I/O.
    `blocks`, when given, is fed the same bytes (per-block digests for partial reads).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    digest = StreamingDigest()
    size = 0
    try:
        with open(tmp, "xb", buffering=0) as handle:
            behind = WriteBehind(handle)
            try:
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    behind.put(view)
                    digest.update(view)
                    if blocks is not None:
                        blocks.update(view)
                    size += len(view)
            finally:
                behind.close()
            os.fsync(handle.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return FileRecord(bytes=size, digest=digest.hexdigest())


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside the directory `path` durable; OSError propagates."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
