"""This process's save attempts in flight: which staging directories belong to a live attempt.

A coordinator makes `<root>/.staging-<attempt id>` only while it holds the root's writer lease.
The directory goes when the attempt ends: renamed to its generation, or removed. So while this
process holds the lease, a staging directory is live only if one of its own attempts registered it
(`begin`, then `end`). Any other one was left by a crashed or abandoned attempt, which the next save
reclaims (`retention.reclaim_staging`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["begin", "end", "live"]

_lock = threading.Lock()
_live: dict[tuple[int, str], set[str]] = {}  # (pid, root) -> staging directory names in flight


def begin(root: Path, name: str) -> None:
    """Record that an attempt of this process is about to make and use `root/name`."""
    with _lock:
        _live.setdefault((os.getpid(), str(Path(root))), set()).add(name)


def end(root: Path, name: str) -> None:
    """Forget `root/name`: the attempt that owned it ended (published or removed)."""
    key = (os.getpid(), str(Path(root)))
    with _lock:
        names = _live.get(key)
        if names is not None:
            names.discard(name)
            if not names:
                del _live[key]


def live(root: Path) -> frozenset[str]:
    """The staging directory names of `root` that this process's attempts in flight own.

    A forked child owns none of its parent's.
    """
    with _lock:
        return frozenset(_live.get((os.getpid(), str(Path(root))), ()))
