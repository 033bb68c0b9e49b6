"""Opening regular files, and nothing else, without blocking.

Shared by the file readers (`file_reader`, `read_ahead`), `lease` and `signing`. It imports nothing
of the package, so `layout -> signing` never leads back to `layout` through the readers. A path is
judged from `lstat` first: a FIFO, device, socket, directory or link is refused unopened, so
nothing blocks. A regular file is opened `O_NOFOLLOW|O_NONBLOCK` and checked again once open.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["file_kind", "open_regular", "read_regular"]


def file_kind(mode: int) -> str:
    """The kind of file `mode` (an `st_mode`) names, such as `regular file` or `fifo`."""
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def require_regular(st: os.stat_result) -> None:
    """Raise ValueError unless `st` (from lstat) is a regular file."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"is a {file_kind(st.st_mode)}, not a regular file")


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """Open the regular file `path` for reading; returns its descriptor and `fstat`.

    Anything else is refused from `lstat` without being opened: ValueError with the reason, or
    OSError. The descriptor is checked again (same inode, still regular), so a file swapped for a
    FIFO or a link in between cannot block or redirect the read.
    """
    before = os.lstat(path)
    require_regular(before)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise ValueError("was replaced while being opened")
    except BaseException:
        os.close(fd)
        raise
    return fd, now


def read_regular(path: Path, *, max_bytes: int) -> bytes:
    """The whole content of a small regular file of at most `max_bytes`.

    A larger file is refused before it is read. Raises ValueError or OSError with the reason.
    """
    fd, st = open_regular(Path(path))
    try:
        if st.st_size > max_bytes:
            raise ValueError(f"is {st.st_size} bytes, more than the {max_bytes} such a file may have")
        data = os.pread(fd, max_bytes + 1, 0)
        if len(data) > max_bytes:
            raise ValueError(f"grew past {max_bytes} bytes while being read")
        return data
    finally:
        os.close(fd)
