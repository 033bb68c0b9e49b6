"""`core.dcp_metadata`: the data-only reader of torch DCP's `.metadata`, and `native_dist.read_chunk`.

Real metadata comes from torch's own `torch.distributed.checkpoint.save` (single process) here, and
from megatron-core's `dist_checkpointing.save` on both megatron tiers in test_single_lora.py
(`test_dcp_metadata_reader_reads_megatrons_real_metadata_as_torch_does`). Hostile streams are
written with `pickle.dumps` (test inputs only; nothing here ever unpickles) and by hand; each must
be refused without anything from it running: a sentinel file a successful attack would create
must not exist afterwards.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import struct
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch

from miles_lora_ckpt.core import dcp_metadata, native_dist
from miles_lora_ckpt.core.dcp_metadata import BytesEntry, DcpMetadataError, parse_metadata, read_metadata


def _torch_dcp_save(directory: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {
        "a.lora_A.weight": torch.arange(12, dtype=torch.bfloat16).view(3, 4),
        "b.lora_B.weight": torch.randn(5, 2, dtype=torch.float32),
        "extra_state": {"iteration": 7},  # a BYTE_IO item: never read
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory))
    return state


def test_reader_reads_torch_dcp_metadata_and_chunks_as_torch_does(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    state = _torch_dcp_save(tmp_path)
    ours = read_metadata(tmp_path / ".metadata")
    theirs = FileSystemReader(str(tmp_path)).read_metadata()  # the reference (unpickles; test only)
    assert sorted(ours.entries) == sorted(theirs.state_dict_metadata)
    assert [n for n, e in ours.entries.items() if isinstance(e, BytesEntry)] == ["extra_state.iteration"]
    for name in ("a.lora_A.weight", "b.lora_B.weight"):
        entry, item = ours.entries[name], theirs.state_dict_metadata[name]
        assert f"torch.{entry.dtype}" == str(item.properties.dtype) and entry.size == tuple(item.size)
        assert [(c.offsets, c.sizes) for c in entry.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
        chunk = native_dist.read_chunk(tmp_path, ours, name, entry.chunks[0])
        assert chunk.dtype == state[name].dtype and torch.equal(chunk, state[name])
    expected = {
        (i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
        for i, s in theirs.storage_data.items()
    }
    assert {k: (v.relative_path, v.offset, v.length) for k, v in ours.storage.items()} == expected


def test_reader_takes_the_wide_forms_of_ints_and_strings():
    """BININT, LONG1 (offsets past 2 GiB), BINUNICODE (names of 256+ bytes), several chunks: built
    from torch's own dataclasses, pickled as DCP does."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    name = "layers." + "x" * 300 + ".lora_B.weight"
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([70000, 2])),
        ChunkStorageMetadata(torch.Size([70000, 0]), torch.Size([70000, 2])),
    ]
    item = TensorStorageMetadata(TensorProperties(dtype=torch.float16), torch.Size([140000, 2]), chunks)
    storage = {
        MetadataIndex(name, torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 100_000, 560_000),
        MetadataIndex(name, torch.Size([70000, 0])): _StorageInfo("__1_0.distcp", 3 << 30, 560_000),
    }
    ours = parse_metadata(pickle.dumps(Metadata({name: item}, storage_data=storage), protocol=4))
    entry = ours.entries[name]
    assert entry.dtype == "float16" and entry.size == (140000, 2)
    assert [c.offsets for c in entry.chunks] == [(0, 0), (70000, 0)]
    assert ours.storage[(name, (70000, 0))].offset == 3 << 30
    assert ours.storage[(name, (0, 0))].offset == 100_000


class _Attack:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _frame(body: bytes) -> bytes:
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


@pytest.fixture
def sentinel(tmp_path):
    path = tmp_path / "sentinel"
    yield path
    assert not path.exists(), "something from the stream ran"


def _refused(tmp_path: Path, data: bytes, *fragments: str) -> str:
    file = tmp_path / ".metadata"
    file.write_bytes(data)
    with pytest.raises(DcpMetadataError) as refused:
        read_metadata(file)
    message = str(refused.value)
    assert str(file) in message and "refusing" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_hostile_globals_are_refused_without_running(tmp_path, sentinel):
    command = f"touch {sentinel}"
    _refused(tmp_path, pickle.dumps(_Attack(os.system, command), protocol=4), "global posix.system is not allowed")
    _refused(tmp_path, pickle.dumps(_Attack(eval, f"open({str(sentinel)!r}, 'w')"), protocol=4), "global builtins.eval")
    # the same global inside an otherwise real Metadata: refused where it appears
    from torch.distributed.checkpoint.metadata import Metadata

    nested = pickle.dumps(Metadata({"x": _Attack(os.system, command)}), protocol=4)
    _refused(tmp_path, nested, "global posix.system")
    # protocol 0-3's text GLOBAL opcode is not one DCP metadata uses
    _refused(tmp_path, _frame(b"cos\nsystem\n" + _s(command) + b"\x85R."), "opcode b'c'")


def test_allowlisted_names_used_for_what_they_are_not_are_refused(tmp_path, sentinel):
    dtype = _s("torch") + _s("bfloat16") + b"\x93"
    metadata = _s("torch.distributed.checkpoint.metadata") + _s("Metadata") + b"\x93"
    size = _s("torch") + _s("Size") + b"\x93"
    _refused(tmp_path, _frame(dtype + _s("x") + b"\x85R."), "REDUCE of")  # a dtype is not callable
    _refused(
        tmp_path,
        _frame(metadata + _s("x") + b"\x85R."),
        "REDUCE of global torch.distributed.checkpoint.metadata.Metadata",
    )
    _refused(tmp_path, _frame(size + b")\x81."), "NEWOBJ of global torch.Size")
    _refused(tmp_path, _frame(metadata + _s("x") + b"\x85\x81."), "NEWOBJ of")  # arguments
    _refused(tmp_path, _frame(size + _s("x") + b"\x85\x85R."), "torch.Size of")
    _refused(
        tmp_path,
        _frame(_s("torch.serialization") + _s("_get_layout") + b"\x93" + _s("os.system") + b"\x85R."),
        "_get_layout of",
    )


def test_unknown_truncated_oversize_and_malformed_streams_are_refused(tmp_path, sentinel, monkeypatch):
    _torch_dcp_save(tmp_path / "real")
    real = (tmp_path / "real" / ".metadata").read_bytes()
    assert read_metadata(tmp_path / "real" / ".metadata").entries  # the intact one reads
    _refused(tmp_path, real[: len(real) // 2], "truncated")
    _refused(tmp_path, real + b"N", "after STOP")
    _refused(tmp_path, b"", "not a pickle stream")
    _refused(tmp_path, _frame(b"\xff."), "opcode b'\\xff'")
    _refused(tmp_path, _frame(b"G" + b"\0" * 8 + b"."), "opcode b'G'")  # BINFLOAT: not used by DCP
    _refused(tmp_path, _frame(b"\x8a\x09" + b"\1" * 9 + b"."), "LONG1 of 9 bytes")
    _refused(tmp_path, _frame(b"N\x81."), "on an empty stack")
    _refused(tmp_path, _frame(b"NN."), "unbalanced")
    _refused(tmp_path, _frame(b"N."), "top-level object")  # not a Metadata
    monkeypatch.setattr(dcp_metadata, "MAX_METADATA_BYTES", len(real) - 1)
    _refused(tmp_path, real, "more than")


def test_memo_and_nesting_abuse_is_refused(tmp_path, sentinel):
    _refused(tmp_path, _frame(b"h\x05."), "BINGET 5: no such memo entry")
    _refused(tmp_path, _frame(b"j\xff\xff\xff\xff."), "LONG_BINGET 4294967295")
    _refused(tmp_path, _frame(b"(" * 65 + b"."), "nested MARKs")
    # a list that contains itself (through the memo), given as Metadata's state_dict_metadata
    metadata = _s("torch.distributed.checkpoint.metadata") + _s("Metadata") + b"\x93)\x81"
    loop = b"]\x94h\x00a"  # EMPTY_LIST, MEMOIZE, BINGET 0, APPEND: the list appended to itself
    state = b"}" + _s("state_dict_metadata") + loop + b"s"
    _refused(tmp_path, _frame(metadata + state + b"b."), "state_dict_metadata is [[a list of 1]], not a dict")
    # a dict whose value is itself
    state = b"}\x94" + _s("state_dict_metadata") + b"h\x00s"
    _refused(tmp_path, _frame(metadata + state + b"b."), "not a TensorStorageMetadata")


_DCP = "torch.distributed.checkpoint"


def _global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"


def _new(module: str, name: str) -> bytes:
    return _global(module, name) + b")\x81"


def _metadata_with(field: str, value: bytes) -> bytes:
    """A Metadata whose `field` is the stream fragment `value` (which leaves one value on the stack)."""
    return _frame(_new(f"{_DCP}.metadata", "Metadata") + b"}" + _s(field) + value + b"sb.")


def _doubling(levels: int, first_memo: int = 0) -> bytes:
    """A tuple that holds the previous one twice, `levels` times over (memo references): 2**levels
    leaves in a few bytes per level."""
    out = b")\x94"
    for level in range(levels):  # the top of the stack and a reference to it: TUPLE2, MEMOIZE
        out += b"h" + bytes([first_memo + level]) + b"\x86\x94"
    return out


def _refused_in_bounds(tmp_path: Path, data: bytes, *fragments: str) -> str:
    """`_refused` within 30 s (seconds at most on a loaded machine; without the bounds: hours) and
    64 MiB of Python allocations (a regression fails, never hangs)."""

    def hung(signum, frame):
        raise TimeoutError("the reader ran for 30 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    tracemalloc.start()
    try:
        message = _refused(tmp_path, data, *fragments)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert peak < 64 << 20, f"{peak} bytes allocated"
    assert re.search(r": at byte \d+: ", message), message
    assert len(message) < 600, message  # stream data is shown in a few elements, never in full
    return message


def test_memo_dags_are_refused_in_bounded_time_and_memory(tmp_path):
    """A few hundred bytes of memo references (a tuple holding the previous one twice, 100 times):
    whatever meets it (an error's description, a torch.Size, a chunk list) is refused at once."""
    dag = _doubling(100)
    _refused_in_bounds(tmp_path, _metadata_with("state_dict_metadata", dag), "state_dict_metadata is ((a tuple of 2")
    _refused_in_bounds(tmp_path, _frame(_global("torch", "Size") + dag + b"\x85R."), "torch.Size of ((a tuple of 2")
    _refused_in_bounds(tmp_path, _frame(_global("pathlib", "PosixPath") + dag + b"R."), "PosixPath with")
    # 3000 references to one 40 KB part as a PosixPath: 120 MB if joined
    part = b"X" + struct.pack("<I", 40_000) + b"p" * 40_000 + b"\x94"
    parts = b"(" + b"h\x00" * 3000 + b"t"
    _refused_in_bounds(tmp_path, _frame(part + _global("pathlib", "PosixPath") + parts + b"R."), "more than 4096")


def test_values_repeated_through_the_memo_are_refused_by_the_work_budget(tmp_path):
    """Honest streams spend about a tenth of their budget; repeating a large value through the
    memo (one chunk list shared by thousands of items, one field dict built into thousands of
    records) runs out of it instead of building gigabytes."""
    md = f"{_DCP}.metadata"
    # memo 0: a torch.Size((1,)); memo 1: a chunk; memo 2: an item with 2000 references to the chunk
    size = _global("torch", "Size") + b"K\x01\x85\x85R\x94"
    chunk = _new(md, "ChunkStorageMetadata") + b"}(" + _s("offsets") + _global("torch", "Size")
    chunk += b"K\x00\x85\x85R" + _s("sizes") + b"h\x00ub\x94"
    props = _new(md, "TensorProperties") + b"}" + _s("dtype") + _global("torch", "float32") + b"sb"
    item = _new(md, "TensorStorageMetadata") + b"}(" + _s("properties") + props + _s("size") + b"h\x00"
    item += _s("chunks") + b"](" + b"h\x01" * 2000 + b"eub\x94"
    names = b"".join(_s(f"n{i:06d}") + b"h\x02" for i in range(2000))
    parts = _s("planner_data") + b"](" + size + chunk + item + b"e"  # a field the reader ignores
    state = _s("state_dict_metadata") + b"}(" + names + b"u" + _s("storage_data") + b"}"
    stream = _frame(_new(md, "Metadata") + b"}(" + parts + state + b"ub.")
    _refused_in_bounds(tmp_path, stream, "steps per byte")
    # one dict of 3000 fields built into 3000 records
    fields = b"}(" + b"".join(_s(f"f{i:05d}") + b"N" for i in range(3000)) + b"u\x94"
    builds = b"".join(_new(md, "StorageMeta") + b"h\x00b" for _ in range(3000))
    _refused_in_bounds(tmp_path, _frame(fields + b"](" + builds + b"e."), "steps per byte")


def test_the_values_a_stream_creates_are_bounded(tmp_path, monkeypatch):
    """Each EMPTY_DICT byte costs ~160 bytes of memory: a stream creates at most `_MAX_VALUES`
    values (memo references create none), so 64 MiB of them cannot take 10 GB."""
    _torch_dcp_save(tmp_path / "real")
    monkeypatch.setattr(dcp_metadata, "_MAX_VALUES", 3_000)
    assert read_metadata(tmp_path / "real" / ".metadata").entries  # about 100 values
    _refused_in_bounds(tmp_path, _frame(b"](" + b"}" * 3_001 + b"e."), "creates more than 3000 values")
    _refused_in_bounds(tmp_path, _frame(b")" + b"\x94" * 3_001 + b"."), "more than 3000 memo entries")
    refs = _frame(b"]\x94(" + b"h\x00" * 5_000 + b"e.")  # references to one list: nothing new
    _refused_in_bounds(tmp_path, refs, "top-level object is [[a list of 5000")


def test_deep_nesting_without_marks_is_refused_not_a_recursion_error(tmp_path):
    deep = b")" + b"\x85" * 20_000  # a tuple in a tuple, 20 000 deep (20 times the recursion limit), no MARK
    _refused_in_bounds(tmp_path, _metadata_with("state_dict_metadata", deep), "state_dict_metadata is ((a tuple of 1")
    _refused_in_bounds(tmp_path, _frame(_global("torch", "Size") + deep + b"\x85R."), "torch.Size of")
    items = b"}(" + b"".join(_s(f"x{i}") + deep for i in range(3)) + b"u"
    _refused_in_bounds(tmp_path, _metadata_with("state_dict_metadata", items), "item 'x0'")


def test_long_names_are_shown_cut(tmp_path):
    name = b"X" + struct.pack("<I", 100_000) + b"n" * 100_000  # BINUNICODE
    message = _refused_in_bounds(tmp_path, _metadata_with("state_dict_metadata", b"}" + name + b"Ns"), "item 'nnnn")
    assert "n" * 200 not in message


def test_read_chunk_refuses_ranges_outside_the_file_and_other_paths(tmp_path):
    from dataclasses import replace

    _torch_dcp_save(tmp_path)
    metadata = read_metadata(tmp_path / ".metadata")
    name = "b.lora_B.weight"
    chunk = metadata.entries[name].chunks[0]
    info = metadata.storage[(name, chunk.offsets)]
    cases = {
        "runs past": replace(info, offset=os.path.getsize(tmp_path / info.relative_path)),
        "not a .distcp file here": replace(info, relative_path="../x.distcp"),
        "transforms": replace(info, transforms=("zstd",)),
        "more than its 10 float32 values need": replace(info, length=info.length + (1 << 17)),
        "torch.load(weights_only=True) refused": replace(info, length=info.length - 1),
    }
    for fragment, bad in cases.items():
        metadata.storage[(name, chunk.offsets)] = bad
        with pytest.raises((ValueError, OSError)) as refused:
            native_dist.read_chunk(tmp_path, metadata, name, chunk)
        assert fragment in str(refused.value) and name in str(refused.value), (fragment, refused.value)
