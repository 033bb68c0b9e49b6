"""Where bytes go: crash-safe files, our own streaming safetensors writer, and a strict, bounded reader.

Writing: every file is written under a temporary name, fsynced, then renamed; the digest is
computed on the bytes as they are written, while a thread writes them and the kernel is asked to
start writing them back early (`start_writeback`), so the final fsync has little left to wait for. Tensors are safetensors (readable by the `safetensors`
library as is), everything else JSON. Nothing here unpickles.

Reading (`check_file`): a file is judged from `lstat` before it is opened (a FIFO, device, socket
or link is refused without being opened, so nothing blocks), opened with `O_NOFOLLOW|O_NONBLOCK`
and re-checked on the descriptor, then read once, front to back: every byte is hashed, a
safetensors header is parsed with bounds on its length, depth, shapes and offsets, and every
floating tensor is checked for finiteness slice by slice. With `keep=False` only one slice is in
memory at a time; with `keep=True` the whole file is kept (zero-copy tensors), and only after a
check that it fits in the memory this host has. Nothing allocates more than a file really holds.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import queue
import secrets
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_lora_ckpt.core import bounded
from miles_lora_ckpt.core.digest import BlockDigests, StreamingDigest
from miles_lora_ckpt.core.errors import GenerationDamaged
from miles_lora_ckpt.core.finite import all_finite
from miles_lora_ckpt.core.layout import BlockIndex, FileRecord
from miles_lora_ckpt.core.regular_files import file_kind, open_regular, require_regular

__all__ = ["file_kind", "open_regular", "require_regular"]  # re-exported: readers know them from here

if TYPE_CHECKING:
    import torch

# safetensors dtype tag -> (torch dtype name, item size)
_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_TAG_OF = {torch_name: tag for tag, (torch_name, _) in _DTYPES.items()}
_FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}
# The one limit on a safetensors header (its JSON, in bytes): the safetensors library's own
# (100,000,000 bytes), so that every file we write the library can read, and we read no header it
# would refuse. The reader checks the header length against it; the writer refuses to go past it.
MAX_HEADER_BYTES = 100_000_000
MAX_HEADER_DEPTH = 4  # {name: {"shape": [...]}} and {"__metadata__": {...}}
MAX_TENSOR_RANK = 32
MAX_DIM = 2**48
MAX_STRIDE = 2**62  # every stride (product of trailing dims) must fit torch's int64 sizes
SLICE_BYTES = 4 * 1024 * 1024
BLOCK_BYTES = 4 * 1024 * 1024  # block size of files written for partial reads (`save_tensors(blocks=True)`)
_CHECK_MEMORY_ABOVE = 256 * 1024 * 1024


# --------------------------------------------------------------------------- plain files


def write_file_atomic(
    path: Path, chunks: Iterable[bytes | memoryview], *, blocks: BlockDigests | None = None
) -> FileRecord:
    """Write `chunks` to `path` via temp name + fsync + rename; returns size and digest.

    The writes run on a thread (`_WriteBehind`, at most two chunks queued) while this thread
    produces, checks and hashes the next chunk: `write` and xxhash release the GIL, so the digest
    costs (almost) nothing on top of the I/O. `blocks`, when given, is fed the same bytes
    (per-block digests for partial reads)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    digest = StreamingDigest()
    size = 0
    try:
        with open(tmp, "xb", buffering=0) as handle:
            behind = _WriteBehind(handle)
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


class _WriteBehind:
    """Writes queued views to `handle` in order on a thread; `put` raises a write error promptly,
    `close` waits for every queued byte (or, when leaving on an error, stops after the current one).

    Every `WRITEBACK_BYTES` written, it asks the kernel to start writing that range to the device
    (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, Linux; a hint that waits for nothing and makes
    nothing durable by itself), so the disk works while the rest is produced, hashed and written,
    and the final `fsync` (which still makes every byte durable) has little left to wait for."""

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
            except BaseException as exc:  # noqa: BLE001 - handed to the producer
                self.error = exc

    def put(self, view: memoryview) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put(view)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


WRITEBACK_BYTES = 8 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2


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
    """Ask the kernel to start writing `[offset, offset + nbytes)` of `fd` to the device now (no
    wait, no durability: only `fsync` gives that). A no-op where the call does not exist or fails."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_allocatable(nbytes: int, what: str = "file") -> None:
    """Refuse to allocate a buffer larger than the memory this host has available: a ValueError, not
    damage (the file may be intact; a load fails rather than fall back to older state for it)."""
    if nbytes < _CHECK_MEMORY_ABOVE:
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


class _Reader:
    """Sequential reads of one open regular file; every byte handed out is hashed exactly once.

    With `keep` the bytes land in one buffer of the file's size (an anonymous map for a large
    safetensors file: `large_buffer`), read ahead by background threads (`_ReadAhead`: `preadv`
    releases the GIL, and so do xxhash and torch's finiteness check), so the next chunks are in
    flight while this one is hashed and checked. Otherwise they land in a
    reused scratch buffer of at most one slice (or one safetensors header), so memory stays bounded.
    """

    def __init__(self, fd: int, size: int, *, keep: bool, block_bytes: int | None = None, anonymous: bool = False):
        self.handle = open(fd, "rb", buffering=0, closefd=False)  # noqa: SIM115 - closed by close()
        self.size, self.pos = size, 0
        self.digest = StreamingDigest()
        self.blocks = BlockDigests(block_bytes) if block_bytes else None
        self.buffer = (large_buffer(size) if anonymous else bytearray(size)) if keep else None
        self._scratch = bytearray(0)
        self._ahead = _ReadAhead(self.handle, self.buffer) if keep and size > READ_AHEAD_CHUNK else None

    def read(self, n: int) -> memoryview:
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
        while self.pos < self.size:
            self.read(min(SLICE_BYTES, self.size - self.pos))

    def finish(self, record: FileRecord | None) -> None:
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
        if self._ahead is not None:
            self._ahead.stop()
        self.handle.close()


READ_AHEAD_CHUNK = 4 * 1024 * 1024
READ_AHEAD_THREADS = 2


class _ReadAhead:
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
        with self._cond:
            while self.filled < end and not self.done:
                self._cond.wait()
        if self.filled < end:
            raise self.error if self.error is not None else ValueError("read ahead stopped early")

    def stop(self) -> None:
        self._stop = True
        for thread in self._threads:
            thread.join()


ANONYMOUS_ABOVE = 1024 * 1024


def large_buffer(nbytes: int):
    """A zeroed, writable buffer of `nbytes`: a bytearray, or above `ANONYMOUS_ABOVE` a private
    anonymous memory map, whose pages go back to the operating system as soon as the last
    reference (a zero-copy tensor included) is dropped, instead of staying in the heap (bounded
    memory: a read's transient buffers never accumulate). Private, not Python's default shared
    mapping: a shared anonymous map is shmem, whose page faults and unmapping cost several times
    more (measured here: a 95 MB read into it 93-115 ms against 61-69 ms, freeing it 26 ms
    against 9 ms), and a forked process has no business sharing a load's buffers."""
    if nbytes <= ANONYMOUS_ABOVE:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def release_zero_pages(buffer) -> int:
    """Give the pages of a `large_buffer` memory map that hold only zero bytes back to the operating
    system, and return how many bytes that was (0 for any other buffer). Nothing it holds changes:
    a private anonymous map reads a released page back as zeros. A load's adapter buffer holds, once
    swapped into the parameters, their old bytes: a relaunch's zero-initialised LoRA B matrices."""
    if not isinstance(buffer, mmap.mmap) or len(buffer) < mmap.PAGESIZE:
        return 0
    torch = _torch()
    page, chunk = mmap.PAGESIZE, 256  # pages looked at together
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


def _open_checked(path: Path) -> tuple[int, os.stat_result]:
    """`open_regular` for a check: its refusal of what is not a regular file (a FIFO, a link, a
    file swapped while being opened) is damage of that file."""
    try:
        return open_regular(path)
    except ValueError as exc:
        raise GenerationDamaged(str(exc)) from None


def read_file_verified(path: Path, record: FileRecord | None = None, *, max_bytes: int | None = None) -> bytearray:
    """Read a whole regular file in one pass; check size and digest against `record` when given.

    `max_bytes` bounds files that are small by nature (manifest, tracker, lease), so a huge or
    sparse one is refused before anything is allocated.
    """
    fd, st = _open_checked(Path(path))
    try:
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise GenerationDamaged(f"is {size} bytes, more than the {max_bytes} such a file may have")
        if record is not None and size != record.bytes:
            raise GenerationDamaged(f"size is {size} bytes, manifest says {record.bytes}")
        ensure_allocatable(size)
        reader = _Reader(fd, size, keep=True)
        try:
            reader.skip_rest()
            reader.finish(record)
        finally:
            reader.close()
        return reader.buffer
    finally:
        os.close(fd)


def json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()


def write_json(path: Path, obj) -> FileRecord:
    return write_file_atomic(path, [json_bytes(obj)])


def parse_json(raw: bytes | bytearray, *, what: str = "JSON"):
    """Strict, bounded JSON (see `bounded.parse_json`) of a file read: a refusal is GenerationDamaged."""
    try:
        return bounded.parse_json(raw, what=what)
    except ValueError as exc:  # bounded's refusals of the bytes (and only those: it raises nothing else)
        raise GenerationDamaged(str(exc)) from None


def read_json(path: Path, record: FileRecord | None = None, *, max_bytes: int = bounded.MAX_JSON_BYTES):
    return parse_json(read_file_verified(path, record, max_bytes=max_bytes), what=Path(path).name)


# --------------------------------------------------------------------------- checked reads


@dataclass
class CheckedFile:
    """One file read and checked by `check_file`."""

    size: int
    buffer: bytearray | None = None  # the whole file, with keep=True (and always for JSON)
    metadata: dict[str, str] | None = None  # safetensors `__metadata__`
    entries: dict[str, tuple[str, list[int], int, int]] | None = None  # safetensors tensors
    value: Any = None  # parsed JSON

    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over the kept buffer."""
        if self.buffer is None or self.entries is None:
            raise ValueError("not a safetensors file read with keep=True")
        return tensors_from_buffer(self.buffer, self.entries)


def check_file(path: Path, record: FileRecord | None = None, *, keep: bool = True) -> CheckedFile:
    """Read one file once and check it: size and digest (against `record`), and by its suffix a
    strict safetensors header with every floating tensor finite, or strict bounded JSON.

    Raises ValueError (or OSError) with the reason. `keep=False` keeps memory to one slice.
    """
    path = Path(path)
    kind = "safetensors" if path.name.endswith(".safetensors") else "json" if path.name.endswith(".json") else "raw"
    fd, st = _open_checked(path)
    try:
        size = st.st_size
        if record is not None and size != record.bytes:
            raise GenerationDamaged(f"size is {size} bytes, manifest says {record.bytes}")
        if kind == "json" and size > bounded.MAX_JSON_BYTES:
            raise GenerationDamaged(f"JSON file is {size} bytes, more than the {bounded.MAX_JSON_BYTES} allowed")
        keep = keep or kind == "json"
        if keep:
            if kind == "safetensors" and size >= _CHECK_MEMORY_ABOVE:
                _precheck_header(fd, size)  # damage is named as such, whatever memory this host has
            ensure_allocatable(size)
        block_bytes = record.blocks.block_bytes if record is not None and record.blocks is not None else None
        reader = _Reader(fd, size, keep=keep, block_bytes=block_bytes, anonymous=kind == "safetensors")
        try:
            checked = CheckedFile(size)
            if kind == "safetensors":
                checked.metadata, checked.entries = _read_safetensors(reader)
                if record is not None and record.blocks is not None:
                    _check_block_spans(record.blocks, checked.entries)
            else:
                reader.skip_rest()
            reader.finish(record)
        finally:
            reader.close()
        checked.buffer = reader.buffer
        if kind == "json":
            checked.value = parse_json(reader.buffer, what=path.name)
        return checked
    finally:
        os.close(fd)


def _precheck_header(fd: int, size: int) -> None:
    """Parse a safetensors header (read with `pread`, not hashed) before a large file is kept whole,
    so that a file its header does not describe (a sparse or grown one) is refused for that, the
    reason `verify` gives when it streams the file, rather than for the memory it would take."""
    if size < 8:
        return
    head = os.pread(fd, 8, 0)
    if len(head) < 8:  # shrank since its stat: damage, not a struct error
        raise GenerationDamaged(f"file shrank while reading ({size} bytes expected)")
    (header_len,) = struct.unpack("<Q", head)
    check_header_length(header_len, size)
    raw = os.pread(fd, header_len, 8)
    if len(raw) == header_len:
        _parse_header(raw, 8 + header_len, size)


def _read_safetensors(reader: _Reader) -> tuple[dict[str, str], dict]:
    if reader.size < 8:
        raise GenerationDamaged(f"too short for a safetensors file ({reader.size} bytes)")
    (header_len,) = struct.unpack("<Q", reader.read(8))
    check_header_length(header_len, reader.size)
    header = bytes(reader.read(header_len))
    metadata, entries = _parse_header(header, 8 + header_len, reader.size)
    for name, (tag, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2]):
        torch_name, itemsize = _DTYPES[tag]
        step = SLICE_BYTES - SLICE_BYTES % itemsize
        remaining = end - begin
        while remaining:
            view = reader.read(min(step, remaining))
            remaining -= len(view)
            if tag in _FLOAT_TAGS and not all_finite(_torch().frombuffer(view, dtype=getattr(_torch(), torch_name))):
                raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
    return metadata, entries


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class LazyTensor:
    """A tensor the writer asks for only when its bytes are due: `produce()` must return a tensor of
    `dtype` and `shape`. The writer drops it once written, so a file of many lazy tensors never has
    more than one of them in memory (bounded memory for large optimizer state)."""

    dtype: Any  # a torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    def produced(self, name: str) -> torch.Tensor:
        """`produce()`'s tensor, checked against the announced dtype and shape (ValueError naming
        tensor `name` otherwise)."""
        tensor = self.produce()
        if tensor.dtype != self.dtype or tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(
                f"tensor {name!r}: produced {tensor.dtype}{list(tensor.shape)}, announced "
                f"{self.dtype}{list(self.shape)}"
            )
        return tensor


def save_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor | LazyTensor],
    *,
    metadata: dict[str, str] | None = None,
    finite: bool = False,
    blocks: bool = False,
    block_bytes: int | None = None,
) -> FileRecord:
    """Stream `tensors` into a safetensors file without building it in memory first.

    Values may be `LazyTensor`s, produced one at a time as the writer reaches them.
    With `finite=True` every floating tensor must be finite (raises ValueError naming it).
    With `blocks=True` the record also holds per-block digests and each tensor's byte range
    (`BlockIndex`, blocks of `block_bytes`, default `BLOCK_BYTES`), for verified partial reads.
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    bodies = []
    offset = 0
    spans = {}
    for name in sorted(tensors):
        check_tensor_name(name)
        spec = tensors[name]
        dtype, shape = (spec.dtype, tuple(spec.shape)) if isinstance(spec, LazyTensor) else (spec.dtype, spec.shape)
        tag = _TAG_OF.get(str(dtype).removeprefix("torch."))
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors tag")
        nbytes = math.prod(shape) * _DTYPES[tag][1]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (tag, offset, offset + nbytes)
        bodies.append(_slices(name, spec, check_finite=finite and tag in _FLOAT_TAGS))
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(
            f"{path.name}: the safetensors header would be {len(header_bytes)} bytes, more than the "
            f"{MAX_HEADER_BYTES} a reader accepts (too many tensors, or too much metadata, in one file)"
        )
    chunks = itertools.chain([struct.pack("<Q", len(header_bytes)), header_bytes], *bodies)
    digests = BlockDigests(block_bytes or BLOCK_BYTES) if blocks else None
    record = write_file_atomic(path, chunks, blocks=digests)
    record = replace(record, finite=finite)
    if digests is not None:
        start = 8 + len(header_bytes)
        index = {name: (tag, start + begin, start + end) for name, (tag, begin, end) in spans.items()}
        record = replace(record, blocks=BlockIndex(digests.block_bytes, tuple(digests.finish()), index))
    return record


def _slices(name: str, spec, *, check_finite: bool):
    """The tensor's bytes in cache-sized slices, each checked for finiteness just before it is
    hashed and written, so the data crosses memory once instead of once per pass. A `LazyTensor`
    is produced here, when its turn comes, and released when its last slice is written."""
    tensor = spec.produced(name) if isinstance(spec, LazyTensor) else spec
    tensor = tensor.detach().cpu().contiguous()
    flat = tensor.reshape(-1)
    step = max(1, SLICE_BYTES // max(1, tensor.element_size()))
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        if check_finite and not all_finite(part):
            raise ValueError(f"tensor {name!r} holds NaN or Inf; refusing to checkpoint it")
        yield _byte_view(part)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(_torch().uint8).numpy())


def parse_safetensors_header(
    buf: bytes | bytearray,
) -> tuple[dict[str, str], dict[str, tuple[str, list[int], int, int]]]:
    """Strictly parse the header of a whole safetensors file held in `buf`.

    Returns `(metadata, {name: (dtype_tag, shape, begin, end)})` with offsets absolute in `buf`.
    Raises ValueError for anything the format forbids: a header past the end or nested too deep,
    unknown dtypes, boolean or oversized dimensions, sizes that do not match shapes, gaps,
    overlaps or bytes not covered by any tensor.
    """
    if len(buf) < 8:
        raise GenerationDamaged(f"too short for a safetensors file ({len(buf)} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(buf[:8]))
    check_header_length(header_len, len(buf))
    return _parse_header(bytes(buf[8 : 8 + header_len]), 8 + header_len, len(buf))


def check_header_length(header_len: int, size: int) -> None:
    """A safetensors header length must fit `MAX_HEADER_BYTES` and the file (`size` bytes)."""
    if header_len > size - 8:
        raise GenerationDamaged(f"safetensors header length {header_len} exceeds the file (not safetensors?)")
    if header_len > MAX_HEADER_BYTES:
        raise GenerationDamaged(
            f"safetensors header length {header_len} is more than the {MAX_HEADER_BYTES} bytes allowed"
        )


def _parse_header(raw: bytes, data_start: int, total: int) -> tuple[dict[str, str], dict]:
    """The header of a file read; every refusal (its own, `bounded`'s, a tensor name's) is damage."""
    try:
        header = bounded.parse_json(
            raw, what="safetensors header", max_bytes=MAX_HEADER_BYTES, max_depth=MAX_HEADER_DEPTH
        )
        bounded.mapping(header, "safetensors header")
        metadata = header.pop("__metadata__", None) or {}
        try:
            bounded.string_map(metadata, "safetensors __metadata__")
        except ValueError as exc:
            raise ValueError(f"{exc} (it must map strings to strings)") from None
        entries = {name: _parse_entry(name, spec, data_start) for name, spec in header.items()}
        _check_coverage(entries, data_start, total)
    except ValueError as exc:  # a parser of the file's bytes: its refusals (ValueError) are damage
        raise GenerationDamaged(str(exc)) from None
    return metadata, entries


MAX_TENSOR_NAME = 1024
_PATH_CHARACTERS = ("/", "\\")


def check_tensor_name(name: str) -> None:
    """A tensor name in a file we write or read: 1 to `MAX_TENSOR_NAME` printable characters, no
    path character (`/`, `\\`), not `.` or `..`: tensor names become keys, file names and path
    components in exports and tools, so one that could address a path is refused (ValueError)."""
    where = f"tensor {name[:80]!r}"
    if not name or len(name) > MAX_TENSOR_NAME:
        raise ValueError(f"{where}: a tensor name has 1 to {MAX_TENSOR_NAME} characters, this one {len(name)}")
    if any(c in name for c in _PATH_CHARACTERS) or name in (".", "..") or not name.isprintable():
        raise ValueError(f"{where}: the name holds a path or control character (not allowed in a tensor name)")


def _parse_entry(name: str, spec, data_start: int) -> tuple[str, list[int], int, int]:
    check_tensor_name(name)
    where = f"tensor {name[:80]!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise GenerationDamaged(f"{where}: malformed header entry")
    tag, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(tag, str) or tag not in _DTYPES:
        raise GenerationDamaged(f"{where}: unsupported dtype {bounded.show(tag)}")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_RANK:
        raise GenerationDamaged(f"{where}: bad shape {bounded.show(shape)}")
    for axis, dim in enumerate(shape):
        bounded.integer(dim, f"{where}: dimension {axis}", high=MAX_DIM)
    if math.prod(max(dim, 1) for dim in shape) > MAX_STRIDE:
        raise GenerationDamaged(f"{where}: the dimensions {shape} overflow a tensor's size")
    if not (isinstance(offsets, list) and len(offsets) == 2):
        raise GenerationDamaged(f"{where}: bad data_offsets {bounded.show(offsets)}")
    begin, end = (bounded.integer(o, f"{where}: data offset", high=MAX_STRIDE) for o in offsets)
    if end < begin or end - begin != math.prod(shape) * _DTYPES[tag][1]:
        raise GenerationDamaged(f"{where}: {end - begin} bytes do not hold {tag}{shape}")
    return tag, shape, data_start + begin, data_start + end


def _check_coverage(entries: dict, data_start: int, total: int) -> None:
    cursor = data_start
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin != cursor:
            raise GenerationDamaged(f"tensor {name[:80]!r}: gap or overlap at byte {begin} (expected {cursor})")
        cursor = end
    if cursor != total:
        raise GenerationDamaged(f"data section ends at byte {cursor} but the file has {total}")


def tensors_from_buffer(
    buf: bytearray, entries: dict[str, tuple[str, list[int], int, int]], *, require_finite: bool = False
) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over `buf` (they keep it alive); optionally refuse non-finite floats."""
    torch = _torch()
    tensors = {}
    for name, (tag, shape, begin, end) in entries.items():
        dtype = getattr(torch, _DTYPES[tag][0])
        if end == begin:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            count = (end - begin) // _DTYPES[tag][1]
            tensor = torch.frombuffer(buf, dtype=dtype, count=count, offset=begin).reshape(shape)
        if require_finite and tag in _FLOAT_TAGS and not all_finite(tensor):
            raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
        tensors[name] = tensor
    return tensors


def load_tensors(path: Path, record: FileRecord | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read and check (size, digest, header, finiteness) a safetensors file; zero-copy tensors."""
    checked = check_file(Path(path), record, keep=True)
    if checked.entries is None:
        raise ValueError(f"{path} is not a .safetensors file")
    return checked.tensors(), checked.metadata


def _torch():
    import torch

    return torch


# --------------------------------------------------------------------------- partial reads

# (tensor name, first element, end element) of a flattened tensor; or, strided,
# (name, first, end, step, width): the rows `first + i * step + [0, width)` (`strided_rows`)
ElementRange = tuple


def strided_rows(wanted: ElementRange) -> tuple[int, int, int] | None:
    """`(step, width, n)` of a strided element range `(name, first, stop, step, width)`: its `n`
    rows, row `i` the elements `[first + i * step, first + i * step + width)`, the last ending at
    `stop`; None for a plain range `(name, first, stop)`. A read of a strided range verifies every
    block under `[first, stop)`, as a plain one does, and returns its rows only, one after the
    other (`n * width` elements: `range_numel`). Raises ValueError for any other shape."""
    if len(wanted) == 3:
        return None
    if len(wanted) != 5 or not all(type(v) is int for v in wanted[1:]):
        raise ValueError(f"an element range is (name, first, stop) or (name, first, stop, step, width), not {wanted!r}")
    _, first, stop, step, width = wanted
    if width <= 0 or step < width or stop - first < width or (stop - first - width) % step:
        raise ValueError(f"strided element range {wanted!r}: rows of {width} every {step} do not end at {stop}")
    return step, width, (stop - first - width) // step + 1


def range_numel(wanted: ElementRange) -> int:
    """How many elements a read of `wanted` returns: `stop - first`, or a strided range's rows'."""
    rows = strided_rows(wanted)
    return wanted[2] - wanted[1] if rows is None else rows[1] * rows[2]


def cut_range(flat, wanted: ElementRange):
    """Elements `wanted` of a flat tensor that holds elements `[first, stop)` of `wanted`'s tensor:
    `flat` itself for a plain range, a new compact tensor of the rows for a strided one."""
    from miles_lora_ckpt.core.global_layout import strided_view  # torch: imported where it is used

    rows = strided_rows(wanted)
    if rows is None:
        return flat
    step, width, n = rows
    return strided_view(flat, flat.numel(), 0, step, width, n).reshape(-1).clone()


def _check_block_spans(index: BlockIndex, entries: dict) -> None:
    """The manifest's tensor byte ranges must be the header's, exactly."""
    found = {name: (tag, begin, end) for name, (tag, _, begin, end) in entries.items()}
    if found != dict(index.tensors):
        raise GenerationDamaged("the safetensors header and the manifest's block index disagree about the tensors")


def byte_range(index: BlockIndex, wanted: ElementRange) -> tuple[int, int]:
    """The absolute bytes `[begin, end)` of an element range, from the manifest's block index."""
    name, first, stop = wanted[:3]
    strided_rows(wanted)  # a strided range's rows must end at its stop
    if name not in index.tensors:
        raise GenerationDamaged(f"tensor {name!r} is not in the file")
    tag, begin, end = index.tensors[name]
    itemsize = _DTYPES[tag][1]
    if not 0 <= first <= stop <= (end - begin) // itemsize:
        raise GenerationDamaged(f"tensor {name!r}: elements [{first}, {stop}) out of its {(end - begin) // itemsize}")
    return begin + first * itemsize, begin + stop * itemsize


def indexed_tensor(index: BlockIndex, name: str) -> tuple[str, int] | None:
    """`(torch dtype name, element count)` of tensor `name` as the manifest's block index records
    it (its dtype tag and byte range; the header must agree, `read_ranges` checks), None if absent."""
    if name not in index.tensors:
        return None
    tag, begin, end = index.tensors[name]
    torch_name, itemsize = _DTYPES[tag]
    return torch_name, (end - begin) // itemsize


def blocks_needed(index: BlockIndex, wanted: Iterable[ElementRange]) -> set[int]:
    """The blocks a partial read of `wanted` reads and verifies: the header's and every range's."""
    needed = set(index.blocks_for(0, index.data_start))
    for item in wanted:
        needed.update(index.blocks_for(*byte_range(index, item)))
    return needed


def mark_blocks(index: BlockIndex, wanted: Iterable[ElementRange], touched: bytearray) -> None:
    """Set `touched[i]` for every block `i` an element range of `wanted` touches (the blocks
    `blocks_needed` names, less the header's), range by range without sorting or merging them
    first: one pass over many short ranges (a resharding load's rows). Raises ValueError for a
    range the file does not hold, as `byte_range` does."""
    block_bytes, tensors = index.block_bytes, index.tensors
    for name, first, stop, *_ in wanted:  # a strided range: every block under [first, stop)
        if name not in tensors:
            raise GenerationDamaged(f"tensor {name!r} is not in the file")
        tag, begin, end = tensors[name]
        itemsize = _DTYPES[tag][1]
        if not 0 <= first <= stop <= (end - begin) // itemsize:
            raise GenerationDamaged(
                f"tensor {name!r}: elements [{first}, {stop}) out of its {(end - begin) // itemsize}"
            )
        if stop > first:
            lo, hi = (begin + first * itemsize) // block_bytes, (begin + stop * itemsize - 1) // block_bytes
            if lo == hi:
                touched[lo] = 1
            else:
                touched[lo : hi + 1] = b"\x01" * (hi + 1 - lo)


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


class _BlockFile:
    """Verified random access to one open file, block by block (only the last block is kept).

    Blocks read in file order from block 0 on, with none skipped, are also hashed into the whole
    file's digest: when a reader ends up reading every block so (`whole_digest`), it checks the
    manifest's file digest too, as a whole read does, without reading anything more."""

    def __init__(self, fd: int, record: FileRecord):
        self.fd, self.record, self.index = fd, record, record.blocks
        self._last: tuple[int, memoryview] | None = None
        self._whole, self._next = StreamingDigest(), 0
        self._buffer = large_buffer(min(self.index.block_bytes, record.bytes))  # reused block after block

    def block(self, i: int, into: memoryview | None = None) -> memoryview:
        """Block `i`, read and its digest checked: into `into` when given (exactly the block's
        length: the caller's destination, so its bytes are copied nowhere else), otherwise into
        the reused buffer, kept as the last block."""
        if self._last is not None and self._last[0] == i:
            if into is not None:
                into[:] = self._last[1]
                return into
            return self._last[1]
        start = i * self.index.block_bytes
        length = min(self.index.block_bytes, self.record.bytes - start)
        if into is None:
            self._last = None
            buf = memoryview(self._buffer)[:length]
        else:
            buf = into
        view, done = buf, 0
        while done < length:
            got = os.preadv(self.fd, [view[done:]], start + done)
            if not got:
                raise GenerationDamaged(f"file shrank while reading ({self.record.bytes} bytes expected)")
            done += got
        digest = StreamingDigest()
        digest.update(buf)
        if digest.hexdigest() != self.index.digests[i]:
            raise GenerationDamaged(
                f"block {i} (bytes {start}..{start + length}) digest mismatch (content changed or corrupted)"
            )
        if i == self._next:
            self._whole.update(buf)
            self._next += 1
        if into is None:
            self._last = (i, buf)
        return buf

    def whole_digest(self) -> str | None:
        """The whole file's digest, when every block was read in file order (else None)."""
        return self._whole.hexdigest() if self._next == len(self.index.digests) else None

    def will_need(self, spans: Iterable[tuple[int, int]]) -> None:
        """`will_need` on this file: its blocks under the byte spans `[begin, end)` are read next."""
        will_need(self.fd, self.record, spans)

    def read(self, begin: int, end: int, out: memoryview) -> None:
        """Copy bytes `[begin, end)` into `out`, every block they touch verified: a block wholly
        inside them is read straight into its place in `out` and verified there (one copy of each
        byte, the kernel's); only the first and last, cut, pass through the reused buffer."""
        block_bytes = self.index.block_bytes
        pos = begin
        while pos < end:
            i = pos // block_bytes
            offset = pos - i * block_bytes
            take = min(end, (i + 1) * block_bytes) - pos
            if offset == 0 and take == min(block_bytes, self.record.bytes - pos):
                self.block(i, out[pos - begin : pos - begin + take])
            else:
                buf = self.block(i)
                out[pos - begin : pos - begin + take] = memoryview(buf)[offset : offset + take]
            pos += take


def read_ranges(
    path: Path,
    record: FileRecord,
    wanted: Iterable[ElementRange],
    *,
    check_only: Iterable[ElementRange] = (),
    allocate=large_buffer,
) -> tuple[dict[ElementRange, torch.Tensor], dict[str, str]]:
    """Read only the blocks that hold `wanted` and `check_only` (element ranges of flattened
    tensors), each block's digest checked against the manifest's block index, the header parsed
    strictly and checked against that index, and every floating value read checked finite. When
    the ranges cover every block of the file (a same-layout DistributedOptimizer load reads its
    slice file so), its whole-file digest is checked as well, as a whole read checks it.

    Returns `({range of wanted: a fresh 1-D tensor}, the file's safetensors metadata)`; the ranges
    of `check_only` are verified the same way and not returned: they share one buffer, reused from
    range to range. A strided range of `wanted` (`strided_rows`) is read whole into that buffer,
    its blocks verified, and its rows copied out into a fresh tensor of their own (only the rows
    are checked finite). Memory: the returned tensors, the largest range of `check_only` or
    strided range, and one block.
    `allocate(nbytes)` gives each returned range its buffer (default: a fresh `large_buffer`).
    All ranges are read in file order. A record without a block index cannot be read partially
    (ValueError).
    """
    if record.blocks is None:
        raise GenerationDamaged("the manifest records no block digests for it: it can only be read whole")
    torch = _torch()
    from miles_lora_ckpt.core.global_layout import strided_view  # with torch: imported where it is used

    fd, st = _open_checked(Path(path))
    try:
        if st.st_size != record.bytes:
            raise GenerationDamaged(f"size is {st.st_size} bytes, manifest says {record.bytes}")
        index = record.blocks
        source = _BlockFile(fd, record)
        if index.data_start < 8:
            raise GenerationDamaged("the manifest's block index puts tensor bytes inside the header length")
        head = bytearray(index.data_start)
        source.read(0, index.data_start, memoryview(head))
        (header_len,) = struct.unpack("<Q", bytes(head[:8]))
        if 8 + header_len != index.data_start:
            raise GenerationDamaged("the safetensors header length disagrees with the manifest's block index")
        metadata, entries = _parse_header(bytes(head[8:]), index.data_start, record.bytes)
        _check_block_spans(index, entries)
        items = [(tuple(item), True) for item in wanted] + [(tuple(item), False) for item in check_only]
        spans = {item: byte_range(index, item) for item, _ in items}
        source.will_need(spans.values())
        # one reused buffer for the spans of the strided ranges kept (their rows are then copied
        # out, compact: the elements between rows are verified with their blocks, never kept), and
        # for the ranges verified and not kept, which pass through it a block at a time
        strided = [e - b for item, kept in items if kept and strided_rows(item) is not None for b, e in [spans[item]]]
        checked = [min(e - b, index.block_bytes) for item, kept in items if not kept for b, e in [spans[item]]]
        scratch = large_buffer(max(strided + checked, default=0))
        out = {}
        for item, kept in sorted(items, key=lambda entry: spans[entry[0]]):
            begin, end = spans[item]
            tag = index.tensors[item[0]][0]
            dtype, itemsize = getattr(torch, _DTYPES[tag][0]), _DTYPES[tag][1]
            if not kept:
                _check_by_blocks(source, begin, end, dtype, itemsize, tag in _FLOAT_TAGS, item[0], scratch)
                continue
            rows = strided_rows(item)
            buf = allocate(end - begin) if kept and rows is None else memoryview(scratch)[: end - begin]
            source.read(begin, end, memoryview(buf))
            tensor = torch.frombuffer(buf, dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
            if rows is not None:  # the rows, one after the other, into a buffer of their own
                step, width, n = rows
                compact = torch.frombuffer(allocate(n * width * itemsize), dtype=dtype)
                compact.view(n, width).copy_(strided_view(tensor, tensor.numel(), 0, step, width, n))
                tensor = compact
            if tag in _FLOAT_TAGS and not all_finite(tensor):
                raise GenerationDamaged(f"tensor {item[0]!r} holds NaN or Inf")
            if kept:
                out[item] = tensor
        whole = source.whole_digest()
        if whole is not None and whole != record.digest:  # every byte read: the file digest is checked too
            raise GenerationDamaged("digest mismatch (content changed or corrupted)")
        return out, metadata
    finally:
        os.close(fd)


def _check_by_blocks(source: _BlockFile, begin: int, end: int, dtype, itemsize: int, floating: bool, name, scratch):
    """Verify bytes `[begin, end)` of one tensor (whole elements), not kept: a block at a time through
    `scratch` (each piece ends at a block's end, so whole blocks are read straight into it), every
    floating element checked finite. Memory: one block, however long the range."""
    torch = _torch()
    block, pos = source.index.block_bytes, begin
    while pos < end:
        boundary = (pos // block + 1) * block  # the end of the block `pos` lies in
        stop = end if boundary >= end else pos + max(itemsize, (boundary - pos) // itemsize * itemsize)
        view = memoryview(scratch)[: stop - pos]
        source.read(pos, stop, view)
        if floating and not all_finite(torch.frombuffer(view, dtype=dtype)):
            raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
        pos = stop


def check_blocks(path: Path, record: FileRecord, blocks: Iterable[int]) -> None:
    """Verify the digests of some blocks of a file (the share of a partially read file that no
    reader reads), and that the floating elements lying wholly inside them are finite."""
    if record.blocks is None:
        raise GenerationDamaged("the manifest records no block digests for it")
    torch = _torch()
    fd, st = _open_checked(Path(path))
    try:
        if st.st_size != record.bytes:
            raise GenerationDamaged(f"size is {st.st_size} bytes, manifest says {record.bytes}")
        index = record.blocks
        source = _BlockFile(fd, record)
        chosen = sorted(set(blocks))
        source.will_need((i * index.block_bytes, (i + 1) * index.block_bytes) for i in chosen)
        for i in chosen:
            buf = source.block(i)
            start, end = i * index.block_bytes, i * index.block_bytes + len(buf)
            for name, (tag, begin, stop) in index.tensors.items():
                if tag not in _FLOAT_TAGS or stop <= start or begin >= end:
                    continue
                itemsize = _DTYPES[tag][1]
                lo = begin + -(-(max(begin, start) - begin) // itemsize) * itemsize
                hi = begin + (min(stop, end) - begin) // itemsize * itemsize
                if hi > lo:
                    part = torch.frombuffer(
                        buf, dtype=getattr(torch, _DTYPES[tag][0]), count=(hi - lo) // itemsize, offset=lo - start
                    )
                    if not all_finite(part):
                        raise GenerationDamaged(f"tensor {name!r} holds NaN or Inf")
    finally:
        os.close(fd)
