"""This process's save attempts in flight: the staging directories that belong to a live attempt.

A save's coordinator makes `<root>/.staging-<attempt id>` only after it took the root's writer
lease, and the directory is gone when the attempt ends (renamed to its generation when published,
removed when the attempt failed), unless the process died first. So while this process holds a
root's lease, a staging directory of that root is live only if it is one of this process's own
attempts in flight (`live`); every other one was left by an attempt whose writer no longer holds
the lease: a crashed or abandoned attempt, which the next save reclaims (`retention.reclaim_staging`).
The protocol registers each attempt here (`begin`) before it makes the directory and forgets it
(`end`) once the directory was published or removed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_lock = threading.Lock()
_live: dict[tuple[int, str], set[str]] = {}  # (pid, root) -> staging directory names in flight


def begin(root: Path, name: str) -> None:
    """Record that an attempt of this process is about to make (and then use) `root/name`."""
    with _lock:
        _live.setdefault((os.getpid(), str(Path(root))), set()).add(name)


def end(root: Path, name: str) -> None:
    """The attempt that owned `root/name` ended (its directory was published or removed)."""
    key = (os.getpid(), str(Path(root)))
    with _lock:
        names = _live.get(key)
        if names is not None:
            names.discard(name)
            if not names:
                del _live[key]


def live(root: Path) -> frozenset[str]:
    """The staging directory names of `root` that this process's attempts in flight own (a forked
    child owns none of its parent's)."""
    with _lock:
        return frozenset(_live.get((os.getpid(), str(Path(root))), ()))
