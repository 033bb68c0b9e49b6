"""A data-only reader of torch DCP's `.metadata` (a stock Miles native `torch_dist` checkpoint).

torch.distributed.checkpoint writes `.metadata` with `pickle.dump(Metadata)`, protocol 4 or 5. The
plugin never unpickles. Its own small interpreter reads the pickle opcodes DCP's metadata uses
(torch 2.13; megatron-core 0.16.1 and 0.19.2) and builds plain records defined here.

Nothing is imported, and nothing from the stream is called. A global is only looked up in
`ALLOWED_GLOBALS`, a fixed table of DCP's dataclasses, dtypes and a few conversions. `REDUCE`
applies only one of five fixed conversions to plain arguments it checks. Anything else raises
`DcpMetadataError` naming the file, the byte offset and the opcode. Records are built by following
DCP's schema field by field, so a self-containing value is the wrong type. Reads are bounded in
memory and work on any input, without recursion: see docs/guarantees.md, "What readers refuse".
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.file_reader import read_file_verified

__all__ = [
    "BytesEntry",
    "Chunk",
    "DcpMetadataError",
    "Metadata",
    "TensorEntry",
    "parse_metadata",
    "read_metadata",
]

MAX_METADATA_BYTES = 64 << 20  # a large model's adapter and optimizer metadata is a few MiB
_MAX_STACK = 1 << 20  # values on the stack (the file's opcodes bound it too)
# Values the stream may create (memo references create none), and memo entries it may make.
# Python spends up to ~160 bytes on one, so 64 MiB of EMPTY_DICT would take 10 GB; this bound
# holds a read to ~650 MB. An honest stream creates about one value per 3 bytes: 4 Mi values is a
# 12 MiB `.metadata`, several times a large model's.
_MAX_VALUES = 1 << 22
_MAX_MARKS = 64  # nested MARKs (DCP's metadata nests 8 deep)
_MAX_DIMS = 32  # dimensions of a tensor
_MAX_PATH = 4096  # characters of a PosixPath rebuilt from its parts
# Work budget: steps of walking stream data per byte of the stream, plus a floor. An honest stream
# spends about one step per ten bytes (each chunk, field and pair costs several opcodes); a memo
# reference spends as much as the value it names, so a forged DAG runs out at once.
_WORK_PER_BYTE = 2
_WORK_FLOOR = 1 << 16

_DCP = "torch.distributed.checkpoint"
# (module, name) -> the record kind it stands for (its class name): the only classes the stream
# may instantiate, per module of torch.distributed.checkpoint.
_CLASS_NAMES = {
    "metadata": "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata TensorProperties "
    "MetadataIndex StorageMeta",
    "filesystem": "_StorageInfo",
    "planner": "SavePlan WriteItem TensorWriteData BytesIOWriteData",
}
_CLASSES = {(f"{_DCP}.{module}", name): name for module, names in _CLASS_NAMES.items() for name in names.split()}
_DTYPES = (
    "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool complex64 complex128 "
    "float8_e4m3fn float8_e5m2 uint16 uint32 uint64"
).split()
_LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc")
# The conversions REDUCE may apply: (module, name) -> kind.
_CONVERSIONS = {
    ("torch", "Size"): "size",
    ("torch.serialization", "_get_layout"): "layout",
    ("pathlib", "PosixPath"): "path",  # torch's own FileSystemWriter records its checkpoint_id as one
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): "memory_format",
    (f"{_DCP}.planner", "WriteItemType"): "write_item_type",
}
_ENUMS = {
    "memory_format": {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"},
    "write_item_type": {1: "TENSOR", 2: "SHARD", 3: "BYTE_IO"},
}
ALLOWED_GLOBALS = frozenset([*_CLASSES, *_CONVERSIONS, *(("torch", d) for d in _DTYPES)])


class DcpMetadataError(MilesLoraCkptError, ValueError):
    """A `.metadata` the data-only reader refuses; the message names the file and why."""


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Chunk:
    """One saved piece of a tensor: its offsets in the global tensor and its sizes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: dtype (torch's name, e.g. "bfloat16"), global size, chunks."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class BytesEntry:
    """A BYTE_IO item (megatron's common state, pickled objects): never read by the plugin."""


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where one item's bytes lie: `relative_path` in the checkpoint directory, offset, length."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple = ()  # DCP's transform descriptors (compression...); the plugin reads none


@dataclass
class Metadata:
    """What the plugin uses of DCP's `Metadata`: every item by name, and where each chunk lies.

    `storage` is keyed by `(name, chunk offsets)`; a BYTE_IO item's offsets are None.
    """

    entries: dict[str, TensorEntry | BytesEntry]
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = field(default_factory=dict)
    version: str | None = None


# ----------------------------------------------------------------------------- interpreter


@dataclass(slots=True)
class _Global:
    module: str
    name: str


@dataclass(eq=False, repr=False, slots=True)
class _Record:
    kind: str
    at: int  # the byte offset of its NEWOBJ (named in errors about its fields)
    fields: dict = field(default_factory=dict)
    state: tuple | None = None  # a BUILD with a tuple state (TensorProperties.__setstate__)


@dataclass(eq=False, repr=False, slots=True)
class _Pairs:
    """A dict under construction: its (key, value) pairs in order; stream objects are not hashed."""

    items: list
    at: int  # the byte offset of its EMPTY_DICT


@dataclass(frozen=True, slots=True)
class _Value:
    kind: str  # "dtype" | "layout" | "memory_format" | "write_item_type"
    name: str


_MARK = object()


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Read DCP's `.metadata` at `path` as data only; returns its `Metadata`.

    Raises DcpMetadataError, naming the file, for anything it refuses or cannot read.
    """
    path = Path(path)
    try:
        data = read_file_verified(path, max_bytes=MAX_METADATA_BYTES)
    except (OSError, ValueError) as exc:
        raise DcpMetadataError(f"{path}: {exc}; refusing to read it (data-only reader)") from None
    return parse_metadata(data, str(path))


def parse_metadata(data: bytes, where: str = "<.metadata>") -> Metadata:
    """`read_metadata` of bytes already read; `where` names them in errors (DcpMetadataError)."""
    if len(data) > MAX_METADATA_BYTES:
        raise DcpMetadataError(
            f"{where}: {len(data)} bytes, more than the {MAX_METADATA_BYTES} allowed; refusing to read it"
        )
    interpreter = _Interpreter(bytes(data), where)
    root = interpreter.run()
    return _to_metadata(root, where, interpreter.charge, len(data) - 1)


class _Interpreter:
    def __init__(self, data: bytes, where: str):
        self.data, self.where, self.pos = data, where, 0
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []
        self.budget = _WORK_PER_BYTE * len(data) + _WORK_FLOOR
        self.created = 0

    def charge(self, steps: int, at: int) -> None:
        """Spend `steps` of the work budget walking stream data at byte `at`; refuse when spent."""
        self.budget -= steps
        if self.budget < 0:
            raise self.fail(
                at,
                f"walking the stream's values takes more than {_WORK_PER_BYTE} steps per byte "
                "(memo references that repeat a value without bound)",
            )

    def fail(self, at: int, why: str) -> DcpMetadataError:
        return DcpMetadataError(f"{self.where}: at byte {at}: {why}; refusing to read it (data-only reader)")

    def take(self, n: int, at: int, op: str) -> bytes:
        if self.pos + n > len(self.data):
            raise self.fail(at, f"truncated stream inside opcode {op}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def push(self, value, at: int, *, new: bool = True) -> None:
        """Push `value` (`new=False`: a memo reference, which creates nothing)."""
        if len(self.stack) >= _MAX_STACK:
            raise self.fail(at, "stack too deep")
        if new:
            self.created += 1
            if self.created > _MAX_VALUES:
                raise self.fail(at, f"the stream creates more than {_MAX_VALUES} values")
        self.stack.append(value)

    def pop(self, at: int, op: str):
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor:
            raise self.fail(at, f"opcode {op} on an empty stack")
        value = self.stack.pop()
        if value is _MARK:
            raise self.fail(at, f"opcode {op} met a MARK")
        return value

    def pop_mark(self, at: int, op: str) -> list:
        if not self.marks:
            raise self.fail(at, f"opcode {op} without a MARK")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def top(self, at: int, op: str):
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor:
            raise self.fail(at, f"opcode {op} on an empty stack")
        return self.stack[-1]

    def run(self):
        if self.data[:1] != b"\x80":
            raise self.fail(0, "not a pickle stream of protocol 4 or 5 (DCP's .metadata is one)")
        while True:
            at = self.pos
            if self.pos >= len(self.data):
                raise self.fail(at, "truncated stream (no STOP)")
            code = self.data[self.pos : self.pos + 1]
            self.pos += 1
            handler = _OPCODES.get(code)
            if handler is None:
                raise self.fail(at, f"opcode {code!r} is not one DCP metadata uses")
            if handler(self, at) is _STOP:
                if self.marks or len(self.stack) != 1:
                    raise self.fail(at, "STOP with an unbalanced stack")
                if self.pos != len(self.data):
                    raise self.fail(at, f"{len(self.data) - self.pos} byte(s) after STOP")
                return self.stack[0]


_STOP = object()
_OPCODES: dict = {}


def _op(code: bytes):
    def register(fn):
        _OPCODES[code] = fn
        return fn

    return register


@_op(b"\x80")
def _proto(self: _Interpreter, at: int):
    if at != 0 or self.take(1, at, "PROTO")[0] not in (4, 5):
        raise self.fail(at, "PROTO other than 4 or 5, or not at the start")


@_op(b"\x95")
def _frame(self: _Interpreter, at: int):
    (length,) = struct.unpack("<Q", self.take(8, at, "FRAME"))
    if length > len(self.data) - self.pos:
        raise self.fail(at, f"FRAME of {length} bytes runs past the end (truncated)")


@_op(b".")
def _stop(self: _Interpreter, at: int):
    return _STOP


@_op(b"(")
def _mark(self: _Interpreter, at: int):
    if len(self.marks) >= _MAX_MARKS:
        raise self.fail(at, f"more than {_MAX_MARKS} nested MARKs")
    self.marks.append(len(self.stack))


@_op(b"\x94")
def _memoize(self: _Interpreter, at: int):
    if len(self.memo) >= _MAX_VALUES:
        raise self.fail(at, f"more than {_MAX_VALUES} memo entries")
    self.memo.append(self.top(at, "MEMOIZE"))


def _get(self: _Interpreter, at: int, index: int, op: str) -> None:
    if index >= len(self.memo):
        raise self.fail(at, f"{op} {index}: no such memo entry ({len(self.memo)} stored)")
    self.push(self.memo[index], at, new=False)


def _text(self: _Interpreter, at: int, size: int, op: str) -> None:
    try:
        self.push(self.take(size, at, op).decode("utf-8"), at)
    except UnicodeDecodeError:
        raise self.fail(at, f"{op}: not UTF-8") from None


def _int(self: _Interpreter, at: int, value: int, op: str) -> None:
    self.push(value, at)


def _with_argument(name: str, fmt: str, use):
    """The handler of an opcode with one fixed-size little-endian argument `fmt`, given to `use`."""

    def handler(self: _Interpreter, at: int):
        use(self, at, struct.unpack(fmt, self.take(struct.calcsize(fmt), at, name))[0], name)

    return handler


for _code, _name, _fmt, _use in (
    (b"h", "BINGET", "<B", _get),
    (b"j", "LONG_BINGET", "<I", _get),
    (b"\x8c", "SHORT_BINUNICODE", "<B", _text),  # the argument: the string's length in bytes
    (b"X", "BINUNICODE", "<I", _text),
    (b"K", "BININT1", "<B", _int),
    (b"M", "BININT2", "<H", _int),
    (b"J", "BININT", "<i", _int),
):
    _OPCODES[_code] = _with_argument(_name, _fmt, _use)


@_op(b"\x8a")
def _long1(self: _Interpreter, at: int):
    size = self.take(1, at, "LONG1")[0]
    if size > 8:
        raise self.fail(at, f"LONG1 of {size} bytes (more than 64 bits)")
    self.push(int.from_bytes(self.take(size, at, "LONG1"), "little", signed=True), at)


@_op(b"N")
def _none(self: _Interpreter, at: int):
    self.push(None, at)


@_op(b"\x88")
def _newtrue(self: _Interpreter, at: int):
    self.push(True, at)


@_op(b"\x89")
def _newfalse(self: _Interpreter, at: int):
    self.push(False, at)


@_op(b")")
def _empty_tuple(self: _Interpreter, at: int):
    self.push((), at)


@_op(b"]")
def _empty_list(self: _Interpreter, at: int):
    self.push([], at)


@_op(b"}")
def _empty_dict(self: _Interpreter, at: int):
    self.push(_Pairs([], at), at)


@_op(b"t")
def _tuple(self: _Interpreter, at: int):
    self.push(tuple(self.pop_mark(at, "TUPLE")), at)


def _tuple_n(n: int, op: str):
    def handler(self: _Interpreter, at: int):
        items = [self.pop(at, op) for _ in range(n)]
        self.push(tuple(reversed(items)), at)

    return handler


_OPCODES[b"\x85"] = _tuple_n(1, "TUPLE1")
_OPCODES[b"\x86"] = _tuple_n(2, "TUPLE2")
_OPCODES[b"\x87"] = _tuple_n(3, "TUPLE3")


def _target(self: _Interpreter, at: int, op: str, kind: type):
    target = self.top(at, op)
    if not isinstance(target, kind):
        raise self.fail(at, f"{op} onto a {type(target).__name__}, not a {kind.__name__.strip('_').lower()}")
    return target


@_op(b"a")
def _append(self: _Interpreter, at: int):
    value = self.pop(at, "APPEND")
    _target(self, at, "APPEND", list).append(value)


@_op(b"e")
def _appends(self: _Interpreter, at: int):
    items = self.pop_mark(at, "APPENDS")
    _target(self, at, "APPENDS", list).extend(items)


@_op(b"s")
def _setitem(self: _Interpreter, at: int):
    value, key = self.pop(at, "SETITEM"), self.pop(at, "SETITEM")
    _target(self, at, "SETITEM", _Pairs).items.append((key, value))


@_op(b"u")
def _setitems(self: _Interpreter, at: int):
    items = self.pop_mark(at, "SETITEMS")
    if len(items) % 2:
        raise self.fail(at, "SETITEMS with an odd number of items")
    _target(self, at, "SETITEMS", _Pairs).items.extend(zip(items[::2], items[1::2], strict=True))


@_op(b"\x93")
def _stack_global(self: _Interpreter, at: int):
    name, module = self.pop(at, "STACK_GLOBAL"), self.pop(at, "STACK_GLOBAL")
    if not isinstance(module, str) or not isinstance(name, str):
        raise self.fail(at, "STACK_GLOBAL of non-strings")
    if (module, name) not in ALLOWED_GLOBALS:
        raise self.fail(at, f"global {module}.{name} is not allowed (not one of torch DCP's metadata types)")
    if module == "torch" and name in _DTYPES:
        self.push(_Value("dtype", name), at)
    else:
        self.push(_Global(module, name), at)


@_op(b"\x81")
def _newobj(self: _Interpreter, at: int):
    args, cls = self.pop(at, "NEWOBJ"), self.pop(at, "NEWOBJ")
    kind = _CLASSES.get((cls.module, cls.name)) if isinstance(cls, _Global) else None
    if kind is None or not (isinstance(args, tuple) and not args):
        raise self.fail(at, f"NEWOBJ of {_show(cls)} with {_show(args)} (only DCP's dataclasses, no arguments)")
    self.push(_Record(kind, at), at)


@_op(b"b")
def _build(self: _Interpreter, at: int):
    state = self.pop(at, "BUILD")
    record = _target(self, at, "BUILD", _Record)
    if isinstance(state, _Pairs):
        self.charge(len(state.items), at)  # a memo'd state may be built into many records
        for key, value in state.items:
            if not isinstance(key, str):
                raise self.fail(at, f"BUILD of {record.kind} with a non-string field name {_show(key)}")
            record.fields[key] = value
    elif isinstance(state, tuple) and record.kind == "TensorProperties":
        record.state = state
    else:
        raise self.fail(at, f"BUILD of {record.kind} with {_show(state)}")


@_op(b"R")
def _reduce(self: _Interpreter, at: int):
    args, fn = self.pop(at, "REDUCE"), self.pop(at, "REDUCE")
    kind = _CONVERSIONS.get((fn.module, fn.name)) if isinstance(fn, _Global) else None
    if kind is None:
        raise self.fail(at, f"REDUCE of {_show(fn)} (only torch.Size, _get_layout, PosixPath and DCP's enums)")
    if kind == "path":
        if not isinstance(args, tuple) or len(args) > _MAX_PATH or not all(isinstance(a, str) for a in args):
            raise self.fail(at, f"REDUCE of pathlib.PosixPath with {_show(args)}")
        self.charge(len(args), at)
        if sum(len(a) for a in args) > _MAX_PATH:  # memo'd parts repeated: checked before joining
            raise self.fail(at, f"a PosixPath of more than {_MAX_PATH} characters")
        self.push("/".join(args).replace("//", "/"), at)  # a string, never a path object
        return
    if not isinstance(args, tuple) or len(args) != 1:
        raise self.fail(at, f"REDUCE of {fn.module}.{fn.name} with {_show(args)}")
    (arg,) = args
    if kind == "size":
        if not isinstance(arg, tuple) or len(arg) > _MAX_DIMS or not all(_is_int(v) and v >= 0 for v in arg):
            raise self.fail(at, f"torch.Size of {_show(arg)}")
        self.push(tuple(arg), at)
    elif kind == "layout":
        if arg not in _LAYOUTS:
            raise self.fail(at, f"_get_layout of {_show(arg)}")
        self.push(_Value("layout", arg), at)
    else:
        names = _ENUMS[kind]
        if not _is_int(arg) or arg not in names:
            raise self.fail(at, f"{fn.name} of {_show(arg)}")
        self.push(_Value(kind, names[arg]), at)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    """At most 80 characters about a stream value, whatever its size, depth or sharing.

    It shows a few elements of a few levels, never a plain `repr`. A container may be a DAG that
    repeats a value without bound, or nested deeper than the recursion limit.
    """
    text = _sketch(value, 2)
    return text if len(text) <= 80 else text[:77] + "..."


def _sketch(value, levels: int) -> str:
    if isinstance(value, _Global):
        return f"global {value.module}.{value.name}"
    if isinstance(value, _Record):
        return f"a {value.kind}"
    if isinstance(value, _Pairs):
        return f"a dict of {len(value.items)} item(s)"
    if isinstance(value, _Value):
        return f"{value.kind} {value.name}"
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, tuple | list):
        if not value:
            return "()" if isinstance(value, tuple) else "[]"
        if levels == 0:
            return f"a {type(value).__name__} of {len(value)}"
        inner = ", ".join(_sketch(item, levels - 1) for item in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if value is None or isinstance(value, bool | int):  # ints are at most 64 bits (LONG1 <= 8 bytes)
        return repr(value)
    return f"a {type(value).__name__}"


# ----------------------------------------------------------------------------- records from the stream


def _to_metadata(root, where: str, charge, end: int) -> Metadata:
    """The records of DCP's schema from the interpreted stream, field by field.

    Every value walked is charged to the interpreter's work budget (`charge(steps, at)`). A refusal
    names the byte offset of the record or dict holding the wrong value; `end` is the root's.
    """

    def bad(at: int, why: str) -> DcpMetadataError:
        return DcpMetadataError(f"{where}: at byte {at}: {why}; refusing to read it (data-only reader)")

    def record(value, kind: str, what: str, at: int) -> _Record:
        if not isinstance(value, _Record) or value.kind != kind:
            raise bad(at, f"{what} is {_show(value)}, not a {kind}")
        return value

    def pairs(value, what: str, at: int) -> list:
        if not isinstance(value, _Pairs):
            raise bad(at, f"{what} is {_show(value)}, not a dict")
        charge(len(value.items), value.at)
        return value.items

    def ints(value, what: str, at: int) -> tuple[int, ...]:
        if not isinstance(value, tuple) or len(value) > _MAX_DIMS or not all(_is_int(v) and v >= 0 for v in value):
            raise bad(at, f"{what} is {_show(value)}, not a torch.Size")
        charge(len(value), at)
        return value

    def text(value, what: str, at: int) -> str:
        if not isinstance(value, str):
            raise bad(at, f"{what} is {_show(value)}, not a string")
        return value

    top = record(root, "Metadata", "the top-level object", end)
    entries: dict[str, TensorEntry | BytesEntry] = {}
    state_dict = top.fields.get("state_dict_metadata")
    for name, value in pairs(state_dict, "state_dict_metadata", top.at):
        at = state_dict.at
        name = text(name, "an item name", at)
        shown = _show(name)
        if name in entries:
            raise bad(at, f"item {shown} is listed twice")
        if isinstance(value, _Record) and value.kind == "BytesStorageMetadata":
            entries[name] = BytesEntry()
            continue
        item = record(value, "TensorStorageMetadata", f"item {shown}", at)
        at = item.at
        properties = item.fields.get("properties")
        if not isinstance(properties, _Record) or properties.kind != "TensorProperties":
            raise bad(at, f"item {shown} has properties {_show(properties)}")
        state = properties.state if properties.state is not None else (properties.fields.get("dtype"),)
        dtype = state[0] if state else None
        if not isinstance(dtype, _Value) or dtype.kind != "dtype":
            raise bad(properties.at, f"item {shown} has dtype {_show(dtype)}")
        size = ints(item.fields.get("size"), f"item {shown} size", at)
        chunks = item.fields.get("chunks")
        if not isinstance(chunks, list):
            raise bad(at, f"item {shown} chunks are {_show(chunks)}")
        charge(len(chunks), at)
        parsed = []
        for chunk in chunks:
            chunk = record(chunk, "ChunkStorageMetadata", f"a chunk of {shown}", at)
            offsets, sizes = (
                ints(chunk.fields.get("offsets"), f"{shown} offsets", chunk.at),
                ints(chunk.fields.get("sizes"), f"{shown} sizes", chunk.at),
            )
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise bad(chunk.at, f"a chunk of {shown} has {len(offsets)}/{len(sizes)} dims, the tensor {len(size)}")
            if any(o + s > g for o, s, g in zip(offsets, sizes, size, strict=True)):
                raise bad(chunk.at, f"a chunk of {shown} at {list(offsets)} of {list(sizes)} exceeds {list(size)}")
            parsed.append(Chunk(offsets, sizes))
        entries[name] = TensorEntry(dtype.name, size, tuple(parsed))
    storage = {}
    storage_data = top.fields.get("storage_data")
    for index, info in pairs(storage_data, "storage_data", top.at):
        index = record(index, "MetadataIndex", "a storage_data key", storage_data.at)
        name = text(index.fields.get("fqn"), "a storage_data fqn", index.at)
        shown = _show(name)
        offset = index.fields.get("offset")
        offset = None if offset is None else ints(offset, f"storage of {shown} offset", index.at)
        info = record(info, "_StorageInfo", f"storage of {shown}", storage_data.at)
        path = text(info.fields.get("relative_path"), f"storage of {shown} relative_path", info.at)
        start, length = info.fields.get("offset"), info.fields.get("length")
        if not (_is_int(start) and _is_int(length) and start >= 0 and length >= 0):
            raise bad(info.at, f"storage of {shown} has offset {_show(start)} and length {_show(length)}")
        transforms = info.fields.get("transform_descriptors") or ()
        if not isinstance(transforms, list | tuple) or not all(isinstance(t, str) for t in transforms[:_MAX_DIMS]):
            raise bad(info.at, f"storage of {shown} has transform descriptors {_show(transforms)}")
        if len(transforms) > _MAX_DIMS:
            raise bad(info.at, f"storage of {shown} has {len(transforms)} transform descriptors")
        storage[(name, offset)] = StorageInfo(path, start, length, tuple(transforms))
    version = top.fields.get("version")
    return Metadata(entries, storage, version if isinstance(version, str) else None)
