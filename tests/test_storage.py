"""Storage layer: our safetensors writer/reader against the real safetensors library, atomic files."""

from __future__ import annotations

import json
import mmap
import os
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lora_ckpt.core import (
    atomic_files,
    bounded,
    checked_reads,
    file_reader,
    host_memory,
    json_files,
    read_ahead,
    safetensors_format,
    safetensors_write,
)
from miles_lora_ckpt.core.digest import digest_bytes

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        base = torch.randn(5, 3, generator=gen) * 10
        out[f"t{i}.{str(dtype)[6:]}"] = base.to(dtype)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    out["noncontig"] = torch.randn(4, 6, generator=gen).t()
    return out


def test_our_file_loads_in_real_safetensors(tmp_path):
    tensors = sample_tensors()
    record = safetensors_write.save_tensors(tmp_path / "a.safetensors", tensors, metadata={"k": "v"})
    loaded = load_file(tmp_path / "a.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    raw = (tmp_path / "a.safetensors").read_bytes()
    assert record.bytes == len(raw) and record.digest == digest_bytes(raw)


def test_real_safetensors_file_loads_in_ours(tmp_path):
    tensors = {k: v.contiguous() for k, v in sample_tensors().items()}
    save_file(tensors, tmp_path / "b.safetensors", metadata={"x": "y"})
    loaded, metadata = checked_reads.load_tensors(tmp_path / "b.safetensors")
    assert metadata == {"x": "y"}
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


def test_atomic_write_leaves_no_temp_and_failure_leaves_nothing(tmp_path):
    json_files.write_json(tmp_path / "ok.json", {"a": 1})
    assert sorted(os.listdir(tmp_path)) == ["ok.json"]

    def failing_chunks():
        yield b"partial"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_files.write_file_atomic(tmp_path / "bad.bin", failing_chunks())
    assert sorted(os.listdir(tmp_path)) == ["ok.json"]


def test_save_refuses_non_finite_when_asked(tmp_path):
    with pytest.raises(ValueError, match="NaN or Inf"):
        safetensors_write.save_tensors(
            tmp_path / "n.safetensors", {"w": torch.tensor([1.0, float("nan")])}, finite=True
        )
    safetensors_write.save_tensors(tmp_path / "n.safetensors", {"w": torch.tensor([1.0, float("inf")])}, finite=False)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:4], "too short"),
        (lambda b: struct.pack("<Q", 10**9) + b[8:], "exceeds the file"),
        (lambda b: b + b"\0\0\0\0", "ends at byte"),
        (lambda b: b[:-4], "ends at byte"),
        (lambda b: b"\x80\x04\x95" + b[3:], "exceeds the file"),
    ],
)
def test_strict_header_parser_rejects(tmp_path, mutate, reason):
    safetensors_write.save_tensors(tmp_path / "c.safetensors", {"a": torch.ones(4), "b": torch.zeros(2, 2)})
    raw = mutate((tmp_path / "c.safetensors").read_bytes())
    with pytest.raises(ValueError, match=reason):
        safetensors_format.parse_safetensors_header(raw)


def test_strict_json_rejects_nan():
    with pytest.raises(ValueError, match="non-finite"):
        json_files.parse_json(b'{"a": NaN}')
    with pytest.raises(ValueError):
        json_files.json_bytes({"a": float("nan")})


def test_digest_mismatch_is_reported(tmp_path):
    record = json_files.write_json(tmp_path / "d.json", {"a": 1})
    data = bytearray((tmp_path / "d.json").read_bytes())
    data[2] ^= 1
    (tmp_path / "d.json").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        file_reader.read_file_verified(tmp_path / "d.json", record)


def test_finiteness_check_is_exact_even_when_a_sum_overflows(tmp_path):
    huge = torch.full((8,), 3.0e38)  # finite values whose float32 sum overflows
    safetensors_write.save_tensors(tmp_path / "h.safetensors", {"w": huge}, finite=True)
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = huge.clone()
        tensor[3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            safetensors_write.save_tensors(tmp_path / "x.safetensors", {"w": tensor}, finite=True)
    mixed = torch.tensor([float("inf"), float("-inf")])  # the sum is NaN, still caught
    with pytest.raises(ValueError, match="NaN or Inf"):
        safetensors_write.save_tensors(tmp_path / "y.safetensors", {"w": mixed}, finite=True)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"[" * 5000 + b"]" * 5000, "nested more than"),
        (b"[" * 70 + b"]" * 70, "nested more than the 64 levels allowed"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": 1e999}', "out of range"),
        (b'{"a": -Infinity}', "non-finite JSON constant -Infinity"),
        (b'{"a": ' + b"9" * 5000 + b"}", "JSON"),
        (b"\xff\xfe", "starts with a byte order mark"),
        # only UTF-8: json.loads would detect and accept these encodings of a valid object
        ('{"a": 1}'.encode("utf-16"), "starts with a byte order mark"),
        ('{"a": 1}'.encode("utf-16-le"), "not valid JSON"),
        ('{"a": 1}'.encode("utf-32-be"), "not valid JSON"),
        (b'\xef\xbb\xbf{"a": 1}', "starts with a byte order mark"),
        (b'{"a": "\xe9"}', "is not UTF-8 \\(byte 7"),
    ],
)
def test_bounded_json_refuses(raw, reason):
    with pytest.raises(ValueError, match=reason):
        bounded.parse_json(raw)


def test_bounded_json_size_limit_and_values():
    with pytest.raises(ValueError, match="more than the 10 allowed"):
        bounded.parse_json(b'{"abcdefgh": 1}', max_bytes=10)
    assert bounded.integer(7, "x") == 7
    for bad in (True, 7.0, -1, 2**63, None, "7"):
        with pytest.raises(ValueError, match="x is"):
            bounded.integer(bad, "x")
    with pytest.raises(ValueError, match="outside"):
        bounded.number(float("nan"), "y")


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_non_regular_files_are_refused_without_being_opened(tmp_path, kind):
    path = tmp_path / "f.json"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would block until a writer comes
    elif kind == "symlink":
        (tmp_path / "real.json").write_text("{}")
        path.symlink_to(tmp_path / "real.json")
    else:
        path.mkdir()
    for read in (file_reader.read_file_verified, checked_reads.check_file, json_files.read_json):
        with pytest.raises(ValueError, match=f"is a {kind}, not a regular file"):
            read(path)


def test_nothing_is_allocated_beyond_the_memory_available(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "available_memory", lambda: 2**30)
    # a sparse terabyte whose header describes it: refused for the memory it would take
    count = 2**40 - 8 - 128
    header = json.dumps({"w": {"dtype": "U8", "shape": [count], "data_offsets": [0, count]}}).encode()
    (tmp_path / "big.safetensors").write_bytes(struct.pack("<Q", 128) + header.ljust(128))
    os.truncate(tmp_path / "big.safetensors", 2**40)
    with pytest.raises(ValueError, match="more than the 1073741824 bytes of memory available"):
        checked_reads.check_file(tmp_path / "big.safetensors", keep=True)
    # a sparse terabyte its header does not describe: refused for that, kept whole or streamed alike
    safetensors_write.save_tensors(tmp_path / "t.safetensors", {"w": torch.zeros(1024, 1024)})
    os.truncate(tmp_path / "t.safetensors", 2**40)
    for keep in (True, False):
        with pytest.raises(ValueError, match="data section ends at byte"):  # judged from the header
            checked_reads.check_file(tmp_path / "t.safetensors", keep=keep)


def test_streamed_checks_hold_one_slice_at_a_time(tmp_path):
    import tracemalloc

    safetensors_write.save_tensors(tmp_path / "big.safetensors", {"w": torch.randn(16 * 1024 * 1024)})  # 64 MiB
    tracemalloc.start()
    try:
        checked = checked_reads.check_file(tmp_path / "big.safetensors", keep=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert checked.buffer is None and checked.entries["w"][1] == [16 * 1024 * 1024]
    assert peak < 2 * host_memory.SLICE_BYTES, peak


@pytest.mark.parametrize(
    "entry, reason",
    [
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "dimension 0 is True, not an integer"),
        ({"dtype": "F32", "shape": [0, 2**40, 2**40], "data_offsets": [0, 0]}, "overflow a tensor's size"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}, "data offset is -16"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]}, "data offset is 0.0, not an integer"),
        ({"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}, "16 bytes do not hold F32"),
        ({"dtype": "X9", "shape": [4], "data_offsets": [0, 16]}, "unsupported dtype"),
    ],
)
def test_header_entries_are_bounded(entry, reason):
    header = json.dumps({"w": entry}).encode()
    raw = struct.pack("<Q", len(header)) + header + bytes(16)
    with pytest.raises(ValueError, match=re.escape(reason)):
        safetensors_format.parse_safetensors_header(raw)


def test_the_header_limit_is_one_number_the_json_limit_does_not_undercut(tmp_path):
    """`MAX_HEADER_BYTES` (the safetensors library's 100,000,000) bounds a header, its JSON included:
    a header of 65 MiB (more than the 64 MiB of other JSON) is read like any other."""
    assert safetensors_format.MAX_HEADER_BYTES == 100_000_000 > bounded.MAX_JSON_BYTES
    safetensors_write.save_tensors(tmp_path / "t.safetensors", {"w": torch.arange(4.0)})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + length] + b" " * (65 * 1024 * 1024)  # trailing whitespace is valid JSON
    metadata, entries = safetensors_format.parse_safetensors_header(
        struct.pack("<Q", len(header)) + header + raw[8 + length :]
    )
    assert list(entries) == ["w"] and entries["w"][0] == "F32"


def test_the_writer_and_every_reader_share_the_header_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_format, "MAX_HEADER_BYTES", 256)
    many = {f"w{i}": torch.zeros(1) for i in range(20)}
    with pytest.raises(ValueError, match="header would be .* bytes, more than the 256 a reader accepts"):
        safetensors_write.save_tensors(tmp_path / "big.safetensors", many)
    monkeypatch.setattr(safetensors_format, "MAX_HEADER_BYTES", 100_000_000)
    safetensors_write.save_tensors(tmp_path / "big.safetensors", many)
    monkeypatch.setattr(safetensors_format, "MAX_HEADER_BYTES", 256)
    for read in (checked_reads.check_file, safetensors_format.parse_safetensors_header):
        arg = (
            tmp_path / "big.safetensors"
            if read is checked_reads.check_file
            else (tmp_path / "big.safetensors").read_bytes()
        )
        with pytest.raises(ValueError, match="is more than the 256 bytes allowed"):
            read(arg)


@pytest.mark.parametrize("name", ["../w", "a/b", "a\\b", "..", ".", "w\n", "w\x00", ""])
def test_tensor_names_with_path_or_control_characters_are_refused_on_write_and_read(tmp_path, name):
    with pytest.raises(ValueError, match="tensor name|path or control character"):
        safetensors_write.save_tensors(tmp_path / "t.safetensors", {name: torch.zeros(1)})
    safetensors_write.save_tensors(tmp_path / "t.safetensors", {"w": torch.zeros(1)})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header[name] = header.pop("w")
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with pytest.raises(ValueError, match="tensor name|path or control character"):
        safetensors_format.parse_safetensors_header(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def test_prefetch_hints_the_blocks_under_the_spans_merged_and_never_fails(tmp_path, monkeypatch):
    from miles_lora_ckpt.core.layout import BlockIndex, FileRecord

    path = tmp_path / "slice.safetensors"
    path.write_bytes(b"\0" * 10_000)
    index = BlockIndex(1024, tuple("d" for _ in range(10)), {"t": ("F32", 8, 10_000)})
    record = FileRecord(10_000, "d", blocks=index)
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, length, advice: calls.append((start, length, advice)))
    # widened to whole blocks, overlapping and touching runs merged, clipped to the file, empty spans dropped
    read_ahead.prefetch(path, record, [(5000, 5001), (10, 20), (1000, 2048), (9500, 20_000), (7000, 7000)])
    assert calls == [
        (0, 2048, os.POSIX_FADV_WILLNEED),
        (4096, 1024, os.POSIX_FADV_WILLNEED),
        (9216, 784, os.POSIX_FADV_WILLNEED),
    ]
    calls.clear()
    read_ahead.prefetch(path, FileRecord(10_000, "d"), None)  # no block index: the whole file
    assert calls == [(0, 10_000, os.POSIX_FADV_WILLNEED)]
    calls.clear()
    # a hint only: a missing file, a FIFO and a link are left to the verified read to report
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(path)
    for name in ("missing", "fifo", "link"):
        read_ahead.prefetch(tmp_path / name, record)
    assert calls == []

    def refuse(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    read_ahead.prefetch(path, record)  # a kernel that refuses the hint fails nothing


def test_a_large_read_buffer_is_private_memory_not_shared_with_a_forked_process():
    """`large_buffer` above `ANONYMOUS_ABOVE` is a private anonymous map: a forked process's writes
    stay its own (Python's default anonymous map is shared, shmem, whose page faults and unmapping
    cost several times more: a load's reads and the freeing of the state it replaced)."""
    buf = host_memory.large_buffer(host_memory.ANONYMOUS_ABOVE + 4096)
    assert len(buf) == host_memory.ANONYMOUS_ABOVE + 4096 and buf[:4] == b"\0\0\0\0"
    pid = os.fork()
    if pid == 0:  # the child writes into its copy and leaves at once
        buf[:4] = b"FORK"
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert buf[:4] == b"\0\0\0\0", "the child's write reached the parent: the buffer is shared memory"
    small = host_memory.large_buffer(16)
    assert isinstance(small, bytearray) and bytes(small) == bytes(16)


def _resident_kib(buffer) -> int:
    """KiB resident (`Rss` in /proc/self/smaps) in the mappings that overlap `buffer`. The kernel may
    split its mapping (`madvise`) or merge it with a neighbour's, so every overlapping line counts;
    a neighbour's pages cancel out of a before/after difference. Smaps, not `mincore`: a released
    page read back maps the shared zero page, which `mincore` reports resident and `Rss` does not."""
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    end, total, overlapping = start + len(buffer), 0, False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(x, 16) for x in head.split("-"))
                overlapping = low < end and start < high
            elif overlapping and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_zero_pages_of_a_read_buffer_go_back_and_read_back_as_zeros():
    """`release_zero_pages`: the pages of a `large_buffer` map holding only zeros leave memory (a
    load's adapter buffer, once it holds a relaunch's zero LoRA B as their undo record), and every
    byte reads back as it was; a page with one byte set stays; a bytearray is left alone."""
    page = mmap.PAGESIZE
    buf = host_memory.large_buffer(host_memory.ANONYMOUS_ABOVE + 300 * page + 100)
    data = torch.frombuffer(buf, dtype=torch.uint8)
    data.fill_(3)
    data[page : 200 * page] = 0
    data[100 * page + 7] = 1  # one byte in a zero run: that page stays
    data[-(page + 100) :] = 0  # the last whole page and the partial one after it
    before = data.clone()
    resident = _resident_kib(buf)
    assert host_memory.release_zero_pages(buf) == (99 + 99 + 1) * page
    assert torch.equal(data, before)
    assert resident - _resident_kib(buf) >= 199 * page // 1024 - 4, (resident, _resident_kib(buf))
    assert host_memory.release_zero_pages(bytearray(2 * page)) == 0
