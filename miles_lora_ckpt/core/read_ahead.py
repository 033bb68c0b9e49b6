"""Reading ahead: threads that fill a buffer while the reader checks what is there, and page-cache hints.

`ReadAhead` reads a whole file into a buffer with several `preadv` requests in flight, so the next
chunks arrive while the reader hashes and checks this one. `will_need` and `prefetch` tell the kernel
which bytes are read soon (`POSIX_FADV_WILLNEED`): hints only, what is read is verified as ever.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.layout import FileRecord
from miles_lora_ckpt.core.regular_files import open_regular

__all__ = ["READ_AHEAD_CHUNK", "READ_AHEAD_THREADS", "ReadAhead", "prefetch", "will_need"]

READ_AHEAD_CHUNK = 4 * 1024 * 1024
READ_AHEAD_THREADS = 2


class ReadAhead:
    """Threads that read a file into `buffer`, chunk `i` by thread `i % READ_AHEAD_THREADS` (`preadv`
    at its offset, several requests in flight at once; the file is marked `POSIX_FADV_SEQUENTIAL`
    first, so the kernel's own read-ahead window grows), and tell how far the buffer is filled
    without a gap; the reader waits only for bytes not yet there. Stops at the end, on `stop()`, or
    on an error (re-raised by `wait_for`)."""

    def __init__(self, handle, buffer: bytearray):
        self.handle, self.buffer = handle, buffer
        self.filled, self.error, self.done, self._stop = 0, None, False, False
        self._cond = threading.Condition()
        self._ready: set[int] = set()  # chunks read beyond `filled`
        self._running = READ_AHEAD_THREADS
        self._threads = [
            threading.Thread(target=self._run, args=(k,), name="mlc-read-ahead", daemon=True)
            for k in range(READ_AHEAD_THREADS)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, first: int) -> None:
        view, size, fd = memoryview(self.buffer), len(self.buffer), self.handle.fileno()
        if first == 0 and hasattr(os, "posix_fadvise"):
            # a hint: the whole file is read in order, so the kernel may read ahead further
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        try:
            for start in range(first * READ_AHEAD_CHUNK, size, READ_AHEAD_THREADS * READ_AHEAD_CHUNK):
                if self._stop or self.error is not None:
                    break
                end = min(size, start + READ_AHEAD_CHUNK)
                pos = start
                while pos < end:
                    got = os.preadv(fd, [view[pos:end]], pos)
                    if not got:
                        raise GenerationDamaged(f"file shrank while reading ({size} bytes expected)")
                    pos += got
                with self._cond:
                    self._ready.add(start)
                    while self.filled in self._ready:
                        self._ready.discard(self.filled)
                        self.filled = min(size, self.filled + READ_AHEAD_CHUNK)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            self.error = exc
        finally:
            with self._cond:
                self._running -= 1
                self.done = self._running == 0 or self.error is not None
                self._cond.notify_all()

    def wait_for(self, end: int) -> None:
        """Wait until the buffer is filled up to byte `end`; raise the error that stopped the threads."""
        with self._cond:
            while self.filled < end and not self.done:
                self._cond.wait()
        if self.filled < end:
            raise self.error if self.error is not None else ValueError("read ahead stopped early")

    def stop(self) -> None:
        """Stop the threads after the chunks they are reading, and wait for them."""
        self._stop = True
        for thread in self._threads:
            thread.join()


def will_need(fd: int, record: FileRecord, spans: Iterable[tuple[int, int]] | None = None) -> None:
    """Tell the kernel that the bytes of an open file under `spans` (`[begin, end)` byte ranges,
    widened to the blocks of `record`'s block index, if any; None: the whole file) are read soon
    (`POSIX_FADV_WILLNEED`): the disk reads them into the page cache while the reader hashes and
    checks what it read before. A hint about the page cache only: what is read is verified as
    ever, and nothing fails if the hint cannot be given."""
    if not hasattr(os, "posix_fadvise"):
        return
    size = record.bytes
    block_bytes = record.blocks.block_bytes if record.blocks is not None else 1
    widened = []  # block-aligned, clipped to the file, then merged: one call per run of blocks
    for begin, end in [(0, size)] if spans is None else spans:
        start, stop = max(0, begin) // block_bytes * block_bytes, min(size, -(-end // block_bytes) * block_bytes)
        if end > begin and stop > start:
            widened.append((start, stop))
    merged: list[list[int]] = []
    for start, stop in sorted(widened):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    for start, stop in merged:
        try:
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)
        except OSError:
            return


def prefetch(path: Path, record: FileRecord, spans: Iterable[tuple[int, int]] | None = None) -> None:
    """`will_need` for the file at `path` (opened as a regular file and closed again: the page cache
    is the file's, not the descriptor's). Anything that prevents it, the reader meets and reports."""
    try:
        fd, _ = open_regular(Path(path))
    except (OSError, ValueError):
        return
    try:
        will_need(fd, record, spans)
    finally:
        os.close(fd)
