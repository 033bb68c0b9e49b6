"""Host memory for reads and writes: what this host has, buffers that give their pages back.

`ensure_allocatable` refuses a buffer larger than the host has. `large_buffer` gives a buffer whose
pages go back to the system with its last reference; `release_zero_pages` returns all-zero pages
early. `SLICE_BYTES` is how much of a file a streamed read or write holds at once.
"""

from __future__ import annotations

import mmap

__all__ = [
    "ANONYMOUS_ABOVE",
    "CHECK_MEMORY_ABOVE",
    "SLICE_BYTES",
    "available_memory",
    "ensure_allocatable",
    "large_buffer",
    "release_zero_pages",
]

SLICE_BYTES = 4 * 1024 * 1024
CHECK_MEMORY_ABOVE = 256 * 1024 * 1024  # smaller buffers are allocated without asking
ANONYMOUS_ABOVE = 1024 * 1024


def ensure_allocatable(nbytes: int, what: str = "file") -> None:
    """Refuse (ValueError) a buffer of `nbytes` larger than the memory this host has available.

    It is not damage: the file may be intact, so a load fails rather than fall back to older state.
    """
    if nbytes < CHECK_MEMORY_ABOVE:
        return
    available = available_memory()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} is {nbytes} bytes, more than the {available} bytes of memory available here")


def available_memory() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo", "rb") as handle:
            for line in handle:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def large_buffer(nbytes: int):
    """A zeroed, writable buffer of `nbytes`.

    Up to `ANONYMOUS_ABOVE` it is a bytearray. Above, it is a private anonymous memory map, whose
    pages go back to the system when the last reference goes, zero-copy tensors included. So a
    read's transient buffers never pile up in the heap. Python's default shared map is shmem: a
    95 MB read into it measured 1.5 times as slow, and freeing it 3 times. A forked child must not
    share a load's buffers anyway.
    """
    if nbytes <= ANONYMOUS_ABOVE:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def release_zero_pages(buffer) -> int:
    """Give the all-zero pages of a `large_buffer` map back to the system; returns how many bytes.

    Any other buffer gives back 0. The content does not change: a released private page reads back
    as zeros. After a load's swap, its adapter buffer holds the old parameters, such as a relaunch's
    zero-initialised LoRA B matrices.
    """
    if not isinstance(buffer, mmap.mmap) or len(buffer) < mmap.PAGESIZE:
        return 0
    import torch  # the core imports torch only when a tensor is touched

    page, chunk = mmap.PAGESIZE, 256  # chunk: pages looked at together
    pages = len(buffer) // page
    words = torch.frombuffer(buffer, dtype=torch.int64, count=pages * page // 8).view(pages, page // 8)
    released, run = 0, None  # run: the first page of the current run of zero pages
    for first in range(0, pages + 1, chunk):
        zero = (~words[first : first + chunk].any(dim=1)).tolist() if first < pages else []
        for i, empty in enumerate([*zero, False] if first + chunk > pages else zero):
            if empty and run is None:
                run = first + i
            elif not empty and run is not None:
                buffer.madvise(mmap.MADV_DONTNEED, run * page, (first + i - run) * page)
                released, run = released + (first + i - run) * page, None
    return released
