"""The file digest: xxh3-128 (sha256 runs at about disk speed here and would double the cost)."""

from __future__ import annotations

import xxhash

__all__ = ["BlockDigests", "StreamingDigest", "digest_bytes"]

ALGORITHM = "xxh3_128"


class StreamingDigest:
    """Feed bytes as they are written or read; `hexdigest()` gives `"xxh3_128:<hex>"`."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_128()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes."""
        self._hasher.update(data)

    def hexdigest(self) -> str:
        """The digest of every byte fed so far."""
        return f"{ALGORITHM}:{self._hasher.hexdigest()}"


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """The digest of `data` in one go, as `"xxh3_128:<hex>"`."""
    hasher = StreamingDigest()
    hasher.update(data)
    return hasher.hexdigest()


class BlockDigests:
    """Digests of consecutive fixed-size blocks of a byte stream (the last one may be shorter).

    Fed the same views as a `StreamingDigest`, in order; views may straddle block boundaries.
    """

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.digests: list[str] = []
        self._hasher = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes; a block's digest is taken each time one fills."""
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.block_bytes - self._filled)
            self._hasher.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.block_bytes:
                self._close_block()

    def finish(self) -> list[str]:
        """Every block's digest; call once, after the last update."""
        if self._filled:
            self._close_block()
        return self.digests

    def _close_block(self) -> None:
        self.digests.append(f"{ALGORITHM}:{self._hasher.hexdigest()}")
        self._hasher = xxhash.xxh3_128()
        self._filled = 0
