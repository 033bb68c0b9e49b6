"""Reading ahead: threads that fill a buffer while the reader checks it, and page-cache hints.

`ReadAhead` keeps several `preadv` requests in flight, so the next chunks arrive while the reader
hashes this one. `will_need` and `prefetch` tell the kernel which bytes are read soon; they are
hints only, and what is read is verified as ever.
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
    """Threads that read the file object `handle` into `buffer`, several chunks in flight at once.

    `filled` says how far the buffer is filled without a gap, so the reader waits only for bytes not
    yet there. The file is marked `POSIX_FADV_SEQUENTIAL`, so the kernel's read-ahead window grows.
    The threads stop at the end, on `stop()`, or on an error, which `wait_for` raises.
    """

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
            # A hint: the whole file is read in order, so the kernel may read ahead further.
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
        except BaseException as exc:  # noqa: BLE001 - the reader raises it
            self.error = exc
        finally:
            with self._cond:
                self._running -= 1
                self.done = self._running == 0 or self.error is not None
                self._cond.notify_all()

    def wait_for(self, end: int) -> None:
        """Wait until the buffer is filled up to byte `end`; raise the error that stopped the reads.

        That is GenerationDamaged for a file that shrank, or the read's OSError.
        """
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
    """Tell the kernel that the bytes of `fd` under `spans` are read soon (`POSIX_FADV_WILLNEED`).

    `spans` are `[begin, end)` byte ranges, widened to the blocks of `record`; None means the whole
    file. The disk fills the page cache while the reader checks earlier bytes. It is a hint only:
    it raises nothing, and what is read is verified as ever.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    size = record.bytes
    block_bytes = record.blocks.block_bytes if record.blocks is not None else 1
    widened = []  # block-aligned, clipped to the file, then merged: one call per run of blocks.
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
    """`will_need` for the file at `path`, opened and closed again; the page cache is the file's.

    It raises nothing: whatever prevents it, the reader meets and reports.
    """
    try:
        fd, _ = open_regular(Path(path))
    except (OSError, ValueError):
        return
    try:
        will_need(fd, record, spans)
    finally:
        os.close(fd)
