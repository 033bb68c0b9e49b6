"""Verified sequential reads of one regular file: every byte hashed once, size and digest checked.

`open_checked` opens a regular file only; anything else is damage, refused unopened. `FileReader`
hands out a file's bytes front to back, hashing each. `read_file_verified` reads a file whole so.
"""

from __future__ import annotations

import os
from pathlib import Path

from miles_lora_ckpt.core.digest import BlockDigests, StreamingDigest
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.host_memory import SLICE_BYTES, ensure_allocatable, large_buffer
from miles_lora_ckpt.core.layout import FileRecord
from miles_lora_ckpt.core.read_ahead import READ_AHEAD_CHUNK, ReadAhead
from miles_lora_ckpt.core.regular_files import open_regular

__all__ = ["FileReader", "open_checked", "read_file_verified"]


class FileReader:
    """Sequential reads of the open regular file `fd` of `size` bytes; each byte is hashed once.

    With `keep` the bytes land in one buffer of the file's size, read ahead by threads
    (`ReadAhead`), so the next chunks are in flight while this one is checked. `anonymous` makes
    that buffer a `large_buffer`. Otherwise they land in a reused scratch buffer of one slice, so
    memory stays bounded. `block_bytes` also hashes blocks of that size.
    """

    def __init__(self, fd: int, size: int, *, keep: bool, block_bytes: int | None = None, anonymous: bool = False):
        self.handle = open(fd, "rb", buffering=0, closefd=False)  # noqa: SIM115 - closed by close()
        self.size, self.pos = size, 0
        self.digest = StreamingDigest()
        self.blocks = BlockDigests(block_bytes) if block_bytes else None
        self.buffer = (large_buffer(size) if anonymous else bytearray(size)) if keep else None
        self._scratch = bytearray(0)
        self._ahead = ReadAhead(self.handle, self.buffer) if keep and size > READ_AHEAD_CHUNK else None

    def read(self, n: int) -> memoryview:
        """The next `n` bytes, hashed; GenerationDamaged if the file has fewer left."""
        if n > self.size - self.pos:
            raise GenerationDamaged(f"needs {n} bytes at offset {self.pos}, the file has {self.size}")
        if self.buffer is not None:
            view = memoryview(self.buffer)[self.pos : self.pos + n]
            if self._ahead is not None:
                self._ahead.wait_for(self.pos + n)
            else:
                self._fill(view)
        else:
            if len(self._scratch) < n:
                self._scratch = bytearray(n)
            view = memoryview(self._scratch)[:n]
            self._fill(view)
        self.digest.update(view)
        if self.blocks is not None:
            self.blocks.update(view)
        self.pos += n
        return view

    def _fill(self, view: memoryview) -> None:
        rest = view
        while rest:
            got = self.handle.readinto(rest)
            if not got:
                raise GenerationDamaged(f"file shrank while reading ({self.size} bytes expected)")
            rest = rest[got:]

    def skip_rest(self) -> None:
        """Read and hash what is left, a slice at a time; raises as `read` does."""
        while self.pos < self.size:
            self.read(min(SLICE_BYTES, self.size - self.pos))

    def finish(self, record: FileRecord | None) -> None:
        """Check that the file did not grow and its digests match `record` (GenerationDamaged)."""
        if self._ahead is not None:
            self._ahead.stop()
        if os.pread(self.handle.fileno(), 1, self.size):
            raise GenerationDamaged(f"file grew while reading ({self.size} bytes expected)")
        if record is not None and self.digest.hexdigest() != record.digest:
            raise GenerationDamaged("digest mismatch (content changed or corrupted)")
        if record is not None and record.blocks is not None and self.blocks is not None:
            bad = [
                i for i, (a, b) in enumerate(zip(self.blocks.finish(), record.blocks.digests, strict=True)) if a != b
            ]
            if bad:
                raise GenerationDamaged(f"block {bad[0]} digest mismatch (the manifest's block digests disagree)")

    def close(self) -> None:
        """Stop reading ahead and close the handle; the descriptor stays the caller's."""
        if self._ahead is not None:
            self._ahead.stop()
        self.handle.close()


def open_checked(path: Path) -> tuple[int, os.stat_result]:
    """`open_regular` for a check; returns the descriptor and its `fstat`.

    A refusal of what is not a regular file is damage of that file (GenerationDamaged). An OSError
    propagates.
    """
    try:
        return open_regular(path)
    except ValueError as exc:
        raise GenerationDamaged(str(exc)) from None


def read_file_verified(path: Path, record: FileRecord | None = None, *, max_bytes: int | None = None) -> bytearray:
    """Read a whole regular file in one pass and return its bytes.

    Size and digest are checked against `record` when given. `max_bytes` bounds files that are small
    by nature (manifest, tracker, lease), refused before anything is allocated. Raises
    GenerationDamaged for a refused file, ValueError when memory is short, or the read's OSError.
    """
    fd, st = open_checked(Path(path))
    try:
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise GenerationDamaged(f"is {size} bytes, more than the {max_bytes} such a file may have")
        if record is not None and size != record.bytes:
            raise GenerationDamaged(f"size is {size} bytes, manifest says {record.bytes}")
        ensure_allocatable(size)
        reader = FileReader(fd, size, keep=True)
        try:
            reader.skip_rest()
            reader.finish(record)
        finally:
            reader.close()
        return reader.buffer
    finally:
        os.close(fd)
