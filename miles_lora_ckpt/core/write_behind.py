"""Write-behind: a file's chunks written on a thread while the caller produces and hashes the next.

Every `WRITEBACK_BYTES`, the kernel is asked to start writing the range to the device
(`start_writeback`), so the final `fsync` has little left to wait for.
"""

from __future__ import annotations

import queue
import threading

__all__ = ["WRITEBACK_BYTES", "WriteBehind", "start_writeback"]

WRITEBACK_BYTES = 8 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2


class WriteBehind:
    """Writes queued views to the file object `handle` in order, on a thread.

    `put` raises a write error promptly; `close` waits for every queued byte and raises it too.
    Every `WRITEBACK_BYTES` it starts the kernel's writeback of that range, a hint that makes
    nothing durable. So the disk works while the rest is produced, and `fsync` has less to wait for.
    """

    def __init__(self, handle):
        self.handle, self.error = handle, None
        self._written = self._kicked = 0
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._run, name="mlc-write-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            view = self._queue.get()
            if view is None:
                return
            if self.error is not None:
                continue  # keep draining so that the producer never blocks
            try:
                while view:
                    written = self.handle.write(view)
                    view = view[written:]
                    self._written += written
                if self._written - self._kicked >= WRITEBACK_BYTES:
                    start_writeback(self.handle.fileno(), self._kicked, self._written - self._kicked)
                    self._kicked = self._written
            except BaseException as exc:  # noqa: BLE001 - the producer raises it
                self.error = exc

    def put(self, view: memoryview) -> None:
        """Queue `view`; blocks while two are queued. Raises a write error met before."""
        if self.error is not None:
            raise self.error
        self._queue.put(view)

    def close(self) -> None:
        """Wait until the thread wrote (after an error: drained) what is queued; raise its error."""
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


def _load_sync_file_range():
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux (or no such call): the final fsync does it all
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing `[offset, offset + nbytes)` of `fd` to the device now.

    Linux's `sync_file_range`: it does not wait and makes nothing durable, only `fsync` does. A
    no-op where the call does not exist or fails; raises nothing.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
