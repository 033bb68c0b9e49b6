"""Property-based fuzzing (Hypothesis) of the parsers themselves: bounded time, bounded memory and
a clear error on any input.

Targets, each with arbitrary inputs and with real ones mutated:

- `dcp-metadata`: `dcp_metadata.read_metadata` of torch DCP's `.metadata` (a pickle stream): random
  bytes after the protocol header; opcode programs drawn from the opcodes DCP uses (memo
  references, MARKs, allowlisted globals, TUPLE/APPEND/SETITEM/BUILD/REDUCE in any order, so DAGs
  and deep nesting); a real stream from `torch.distributed.checkpoint.save` with bytes flipped,
  inserted, cut, or a slice repeated;
- `manifest`: `Manifest.from_json_bytes` (and the tracker's `Tracker.from_dict`, the global
  layout's `Block.from_dict`): a real manifest with a value anywhere replaced by any JSON value
  (huge, deep, wide), a key deleted or added, resealed so that the digest passes; raw bytes edits;
- `safetensors-header`: `safetensors_format.parse_safetensors_header` of a real file whose header is edited
  the same way (its length prefix rewritten), or whose bytes are.

Every example must answer within the alarm (`EXAMPLE_SECONDS`), allocate at most
`EXAMPLE_MEMORY` bytes of Python objects (tracemalloc's peak), and either return or raise a
ValueError (the package's errors are ValueErrors: `DcpMetadataError`, the damage errors) whose
message is at most `MESSAGE_CHARS` long (stream data is shown cut) and, for the DCP reader,
names the file and a byte offset. Anything else (RecursionError, MemoryError, TypeError,
KeyError, a hang) fails the example.

`make test` runs `SHORT_EXAMPLES` per target (derandomized, a few seconds in all);
`make test-long` runs `LONG_EXAMPLES` per target, randomized. Each test prints its slowest example
(`-rP` shows it; `--hypothesis-show-statistics` adds Hypothesis' own counts).
"""

from __future__ import annotations

import json
import re
import signal
import struct
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_lora_ckpt.core import bounded, safetensors_format
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.dcp_metadata import DcpMetadataError, read_metadata
from miles_lora_ckpt.core.digest import digest_bytes
from miles_lora_ckpt.core.global_layout import Block
from miles_lora_ckpt.core.layout import (
    MANIFEST,
    TRACKER,
    FileRecord,
    Manifest,
    Topology,
    Tracker,
    canonical_json,
)
from miles_lora_ckpt.core.protocol import save_generation

SHORT_EXAMPLES, LONG_EXAMPLES = 100, 5000
EXAMPLE_SECONDS = 20  # an example takes milliseconds to a second (under tracemalloc); the alarm catches a hang
EXAMPLE_MEMORY = 48 << 20  # inputs are at most a few hundred KiB
MESSAGE_CHARS = 2000
TARGETS = ("dcp-metadata", "manifest", "safetensors-header")


# --------------------------------------------------------------------------- real inputs


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, bytes]:
    """A real DCP `.metadata`, a real manifest and tracker, a real safetensors file."""
    import torch.distributed.checkpoint as dcp

    where = tmp_path_factory.mktemp("fuzz-readers")
    state = {f"layers.{i}.lora_{ab}.weight": torch.zeros(2, 3) for i in range(3) for ab in "AB"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, "extra": {"iteration": 3}}, checkpoint_id=str(where / "dcp"))

    def write(writer):
        tensors = {"lora_A": torch.ones(2, 3), "lora_B": torch.zeros(3, 2).bfloat16()}
        writer.write_tensors("adapter/dense.safetensors", tensors, binding={"role": "dense-adapter"})
        writer.write_json("training_state.json", {"iteration": 3}, binding={"role": "training-state"})

    gen = save_generation(
        Consensus.single_process(),
        where / "root",
        iteration=3,
        saver="fuzz",
        topology=Topology(),
        write_files=write,
        metadata={"global_layout": {"w": Block("w", (4, 6), (0, 3), (4, 3), "torch.float32").to_dict()}},
    )
    return {
        "dcp-metadata": (where / "dcp" / ".metadata").read_bytes(),
        "manifest": (gen / MANIFEST).read_bytes(),
        "tracker": (where / "root" / TRACKER).read_bytes(),
        "safetensors-header": (gen / "adapter" / "dense.safetensors").read_bytes(),
    }


# --------------------------------------------------------------------------- strategies

TEXT = st.characters(max_codepoint=0x10FF, exclude_categories=("Cs",))  # some non-ASCII, no surrogates
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 2**31, 2**53 + 1, 2**63, 2**64, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(TEXT, max_size=12)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(TEXT, max_size=8), children, max_size=4),
    max_leaves=12,
)
# placeholders replaced in the text by what Hypothesis should not build as objects
BIG = {
    "@deep@": "[" * 5000 + "]" * 5000,
    "@wide-list@": "[" + ",".join(["{}"] * 20_000) + "]",
    "@wide-object@": "{" + ",".join(f'"k{i}":[]' for i in range(10_000)) + "}",
    "@long-string@": json.dumps("x" * 200_000),
    "@huge-int@": "9" * 5000,
    "@nan@": "NaN",
}


WIDEN = "@widen@"


def _paths(value, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value[:8]):
            out += _paths(child, (*prefix, index))
    return out


def mutate_json(data, document) -> str:
    """A structured edit of a parsed JSON document, returned as JSON text."""
    document = json.loads(json.dumps(document))
    path = data.draw(st.sampled_from(_paths(document)), label="path")
    operation = data.draw(st.sampled_from(["replace", "replace", "delete", "add", "big", "widen"]), label="operation")
    value = data.draw(st.sampled_from(sorted(BIG)), label="big") if operation == "big" else None
    if operation == "widen":  # 10 000 more keys in an object on the path (each key a field name)
        target = document
        for step in path:
            target = target[step] if isinstance(target, dict | list) else target
        if isinstance(target, dict):
            target[WIDEN] = 0
        operation, path = "keep", ()
    if value is None and operation not in ("delete", "keep"):
        value = data.draw(JSON_VALUES, label="value")
    if operation == "keep":
        pass
    elif not path:
        document = value
    else:
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        if operation == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif operation == "add" and isinstance(parent, dict):
            parent[data.draw(st.text(TEXT, max_size=10), label="new key")] = value
        else:
            parent[path[-1]] = value
    text = json.dumps(document, sort_keys=True)
    text = text.replace(f'"{WIDEN}": 0', ", ".join(f'"k{i}": 0' for i in range(10_000)))
    for name, replacement in BIG.items():
        text = text.replace(json.dumps(name), replacement)
    return text


def mutate_bytes(data, raw: bytes) -> bytes:
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="byte edits")):
        operation = data.draw(st.sampled_from(["flip", "insert", "cut", "truncate", "repeat"]), label="byte edit")
        where = data.draw(st.integers(0, max(0, len(raw) - 1)), label="offset")
        if operation == "flip" and raw:
            raw[where] ^= 1 << data.draw(st.integers(0, 7))
        elif operation == "insert":
            raw[where:where] = data.draw(st.binary(min_size=1, max_size=8))
        elif operation == "cut" and raw:
            del raw[where : where + data.draw(st.integers(1, 16))]
        elif operation == "truncate":
            del raw[where:]
        elif operation == "repeat" and raw:  # a slice repeated: the same opcodes, memo indices, keys again
            piece = raw[where : where + data.draw(st.integers(1, 64))]
            raw[where:where] = piece * data.draw(st.integers(1, 200))
    return bytes(raw)


_DCP = "torch.distributed.checkpoint"
_GLOBALS = [
    (f"{_DCP}.metadata", name)
    for name in "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata TensorProperties "
    "MetadataIndex _MEM_FORMAT_ENCODING".split()
] + [
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("os", "system"),
]


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _opcode(data) -> bytes:
    """One opcode of the ones DCP's metadata uses (and a few it does not), with its argument."""
    kind = data.draw(
        st.sampled_from(
            "none int int2 long string global empty-tuple empty-list empty-dict mark memoize get get "
            "tuple1 tuple2 tuple3 tuple append appends setitem setitems newobj build reduce".split()
        ),
        label="opcode",
    )
    if kind == "int":
        return b"K" + bytes([data.draw(st.integers(0, 255))])
    if kind == "int2":
        return b"J" + struct.pack("<i", data.draw(st.integers(-(2**31), 2**31 - 1)))
    if kind == "long":
        size = data.draw(st.integers(0, 9))
        return b"\x8a" + bytes([size]) + data.draw(st.binary(min_size=size, max_size=size))
    if kind == "string":
        return _short(data.draw(st.sampled_from(["offsets", "sizes", "chunks", "size", "state_dict_metadata", "x"])))
    if kind == "global":
        module, name = data.draw(st.sampled_from(_GLOBALS))
        return _short(module) + _short(name) + b"\x93"
    if kind == "get":
        return b"h" + bytes([data.draw(st.integers(0, 12))])
    return {
        "none": b"N",
        "empty-tuple": b")",
        "empty-list": b"]",
        "empty-dict": b"}",
        "mark": b"(",
        "memoize": b"\x94",
        "tuple1": b"\x85",
        "tuple2": b"\x86",
        "tuple3": b"\x87",
        "tuple": b"t",
        "append": b"a",
        "appends": b"e",
        "setitem": b"s",
        "setitems": b"u",
        "newobj": b"\x81",
        "build": b"b",
        "reduce": b"R",
    }[kind]


class _Program:
    """A stream built value by value from DCP's opcodes: each value leaves exactly one item on the
    stack, so most programs get past the interpreter to the schema walk (and its error messages)."""

    def __init__(self, data):
        self.data, self.memo = data, 0

    def value(self, depth: int = 0) -> bytes:
        kinds = ["scalar", "string", "ref", "dag", "deep"]
        if depth < 4:
            kinds += ["tuple", "list", "dict", "record", "reduce", "size"]
        kind = self.data.draw(st.sampled_from(kinds), label="value kind")
        if kind == "scalar":
            out = self.data.draw(st.sampled_from([b"N", b"\x88", b"K\x05", b"J\xff\xff\xff\xff", b"\x8a\x02\x01\x80"]))
        elif kind == "string":
            names = ["offsets", "sizes", "chunks", "size", "properties", "dtype", "fqn", "offset", "x", "p" * 300]
            out = _short_or_long(self.data.draw(st.sampled_from(names), label="string"))
        elif kind == "ref":
            if self.memo == 0 or self.data.draw(st.integers(0, 9)) == 0:
                return b"h" + bytes([self.data.draw(st.integers(0, 255))])  # maybe no such entry
            return b"h" + bytes([self.data.draw(st.integers(0, min(self.memo, 256) - 1), label="memo index")])
        elif kind == "dag":  # each tuple holds the previous one twice (memo references)
            levels = self.data.draw(st.integers(1, 80), label="levels")
            first = self.memo
            if first + levels >= 255:
                return b"N"
            out = b")\x94" + b"".join(b"h" + bytes([first + i]) + b"\x86\x94" for i in range(levels))
            self.memo += levels + 1
            return out
        elif kind == "deep":  # nesting far beyond the recursion limit, without a MARK
            out = b")" + b"\x85" * self.data.draw(st.integers(1000, 5000), label="depth")
        elif kind in ("tuple", "list"):
            items = b"".join(self.value(depth + 1) for _ in range(self.data.draw(st.integers(0, 3))))
            out = b"(" + items + b"t" if kind == "tuple" else b"](" + items + b"e"
        elif kind == "dict":
            pairs = b"".join(
                self.value(depth + 1) + self.value(depth + 1) for _ in range(self.data.draw(st.integers(0, 3)))
            )
            out = b"}(" + pairs + b"u"
        elif kind == "record":
            module, name = self.data.draw(st.sampled_from(_GLOBALS), label="class")
            fields = b"".join(
                _short(
                    self.data.draw(
                        st.sampled_from(["offsets", "sizes", "chunks", "size", "properties", "dtype", "fqn"])
                    )
                )
                + self.value(depth + 1)
                for _ in range(self.data.draw(st.integers(0, 3)))
            )
            out = _short(module) + _short(name) + b"\x93)\x81}(" + fields + b"ub"
        else:  # REDUCE of an allowed conversion (or not) with any arguments
            module, name = ("torch", "Size") if kind == "size" else self.data.draw(st.sampled_from(_GLOBALS))
            out = _short(module) + _short(name) + b"\x93" + self.value(depth + 1) + b"\x85R"
        if self.data.draw(st.booleans(), label="memoize") and self.memo < 255:
            self.memo += 1
            out += b"\x94"
        return out


def _short_or_long(text: str) -> bytes:
    raw = text.encode()
    return _short(text) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def dcp_input(data, real_stream: bytes) -> bytes:
    form = data.draw(st.sampled_from(["metadata", "metadata", "opcodes", "mutated", "random"]), label="form")
    if form == "random":
        return b"\x80\x04" + data.draw(st.binary(max_size=512), label="bytes")
    if form == "mutated":
        return mutate_bytes(data, real_stream)
    if form == "opcodes":
        return b"\x80\x04" + b"".join(_opcode(data) for _ in range(data.draw(st.integers(1, 120)))) + b"."
    # a Metadata whose fields are arbitrary values (DAGs, deep nesting, records of any kind)
    program = _Program(data)
    fields = ["state_dict_metadata", "storage_data", "version", "planner_data"]
    chosen = data.draw(st.lists(st.sampled_from(fields), max_size=3, unique=True), label="fields")
    body = b"".join(_short(name) + program.value() for name in chosen)
    return b"\x80\x04" + _short(f"{_DCP}.metadata") + _short("Metadata") + b"\x93)\x81}(" + body + b"ub."


def reseal(text: str) -> bytes:
    """A manifest from JSON text, its self-digest recomputed when it parses (a careless tool or a
    forger without the key); unchanged otherwise."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return text.encode()
    if isinstance(body, dict):
        body.pop("manifest_digest", None)
        try:
            body["manifest_digest"] = digest_bytes(canonical_json(body))
        except (ValueError, RecursionError):
            pass
        text = json.dumps(body)
    return text.encode()


def join_header(text: str, data_section: bytes) -> bytes:
    header = text.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data_section


# --------------------------------------------------------------------------- one example


def draw_case(target: str, data, real: dict[str, bytes], scratch: Path):
    """Draw one input for `target`; returns the read to run on it (which raises only for a failed
    property). Drawing happens outside the measured read."""
    if target == "dcp-metadata":
        file = scratch / ".metadata"
        file.write_bytes(dcp_input(data, real["dcp-metadata"]))
        return lambda: expect_dcp_error(file)
    if target == "manifest":
        which = data.draw(st.sampled_from(["manifest", "manifest", "tracker", "block"]), label="document")
        source = real["tracker"] if which == "tracker" else real["manifest"]
        if data.draw(st.booleans(), label="raw bytes"):
            raw = mutate_bytes(data, source)
        else:
            document = json.loads(source)
            if which == "block":
                document = document["metadata"]["global_layout"]["w"]
            raw = mutate_json(data, document).encode()
            raw = reseal(raw.decode()) if which == "manifest" else raw
        if which == "manifest":
            return lambda: expect_value_error(Manifest.from_json_bytes, raw)
        if which == "tracker":
            return lambda: expect_value_error(lambda r: Tracker.from_dict(bounded.parse_json(r, what=TRACKER)), raw)
        return lambda: expect_value_error(
            lambda r: Block.from_dict(bounded.parse_json(r, what="block"), "block w"), raw
        )
    source = real["safetensors-header"]
    if data.draw(st.booleans(), label="raw bytes"):
        raw = mutate_bytes(data, source)
    else:
        (length,) = struct.unpack("<Q", source[:8])
        header = json.loads(source[8 : 8 + length])
        raw = join_header(mutate_json(data, header), source[8 + length :])
    return lambda: expect_value_error(safetensors_format.parse_safetensors_header, raw)


def expect_dcp_error(file: Path) -> None:
    try:
        read_metadata(file)
    except DcpMetadataError as exc:
        message = str(exc)
        assert str(file) in message and len(message) <= MESSAGE_CHARS, message[:MESSAGE_CHARS]
        assert re.search(r": at byte \d+: ", message), message


def expect_value_error(read, raw: bytes) -> None:
    try:
        read(raw)
    except ValueError as exc:  # the package's errors (DcpMetadataError, damage) are ValueErrors
        message = str(exc)
        assert message and len(message) <= MESSAGE_CHARS, message[:MESSAGE_CHARS]


def _hung(signum, frame):
    raise TimeoutError(f"an example ran for {EXAMPLE_SECONDS} s")


def check_example(target: str, data, real: dict[str, bytes], scratch: Path, worst: dict) -> None:
    """Draw one input, then read it under the alarm and tracemalloc; record the slowest example."""
    read = draw_case(target, data, real, scratch)
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(EXAMPLE_SECONDS)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        read()
        elapsed, peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert peak <= EXAMPLE_MEMORY, f"{peak} bytes allocated"
    worst["examples"] += 1
    worst["slowest_s"] = max(worst["slowest_s"], elapsed)
    worst["peak_bytes"] = max(worst["peak_bytes"], peak)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-scratch")


@pytest.fixture
def worst(request):
    """The run's example count, slowest example and largest peak, printed at the end (`-rP`)."""
    record = {"examples": 0, "slowest_s": 0.0, "peak_bytes": 0}
    yield record
    print(
        f"{request.node.name}: {record['examples']} examples, slowest {record['slowest_s']:.3f} s, "
        f"largest peak {record['peak_bytes']} bytes"
    )


FUZZ_SETTINGS = dict(
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,  # `worst` only counts; nothing is reused across examples
    ],
)


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=SHORT_EXAMPLES, derandomize=True, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_readers(real, scratch, worst, target, data):
    check_example(target, data, real, scratch, worst)


@pytest.mark.long
@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=LONG_EXAMPLES, derandomize=False, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_readers_long(real, scratch, worst, target, data):
    check_example(target, data, real, scratch, worst)


# --------------------------------------------------------------------------- JSON's value count


def test_a_json_document_of_too_many_values_is_refused_before_it_is_built():
    """64 MiB of `[{},{},...]` would take 1.5 GB as Python objects: refused from a count of its
    separators before `json.loads` runs; the same bytes inside a string are no values."""
    wide = b"[" + b"{}," * (bounded.MAX_JSON_VALUES + 10) + b"{}]"
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="more than the 4194304 allowed"):
            Manifest.from_json_bytes(wide)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(wide), f"{peak} bytes allocated for {len(wide)} bytes of input"
    inside = json.dumps({"note": "{}," * (bounded.MAX_JSON_VALUES + 10), "escaped": '\\"[,:'}).encode()
    assert bounded.parse_json(inside)["escaped"] == '\\"[,:'


def test_values_from_disk_are_shown_in_a_bounded_time_and_memory():
    """An error shows a value read from disk through `bounded.show`: 60 characters of it, built
    piece by piece, never a full `repr` of millions of elements."""
    wide = [{"k": [1, 2]}] * 2_000_000
    tracemalloc.start()
    try:
        text = bounded.show(wide)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert text == repr(wide[:6])[:57] + "..." and peak < 64 << 10, (text, peak)
    assert bounded.show(10**5000) == "<an integer of 16610 bits>"  # repr refuses more than 4300 digits
    assert [bounded.show(v) for v in ([1, (2,)], {"a": None}, "x")] == ["[1, (2,)]", "{'a': None}", "'x'"]


def test_keys_read_from_disk_are_named_in_a_bounded_message():
    """A refusal lists at most 8 of the keys it found (and how many): 20 000 unknown keys in a
    manifest, a file record, the topology or a layout block make a short message."""
    wide = {f"k{i}": 0 for i in range(20_000)}
    body = {**json.loads(_MANIFEST_V3), **wide}
    body["manifest_digest"] = digest_bytes(canonical_json(body))
    cases = [
        (lambda: Manifest.from_json_bytes(json.dumps(body).encode()), "unknown fields ['k0', 'k1',"),
        (lambda: Block.from_dict(wide, "block w"), "block w has keys ['k0', 'k1', 'k10', "),
        (lambda: Topology.from_dict(wide, "topology"), "unknown topology keys ['k0', "),
        (lambda: FileRecord.from_dict(wide, "file record"), "file record has keys ['k0', "),
    ]
    for call, fragment in cases:
        with pytest.raises(ValueError) as refused:
            call()
        message = str(refused.value)
        assert fragment in message and "(20000 in all)" in message and len(message) < 400, message[:400]


_MANIFEST_V3 = json.dumps(
    {
        "format": "miles-lora-ckpt",
        "format_version": 3,
        "created_unix_ns": 1,
        "files": {},
        "generation": "0123456789abcdef",
        "iteration": 3,
        "metadata": {},
        "saver": "fuzz",
        "sequence": 1,
        "topology": {"cp": 1, "dp": 1, "ep": 1, "etp": 1, "pp": 1, "tp": 1, "vpp": 1, "world": 1},
    }
)
