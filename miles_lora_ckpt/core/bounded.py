"""Bounded parsing of everything read from disk: JSON with size and depth limits, checked values.

Every byte a checkpoint holds may be hostile or damaged, so nothing read from disk reaches the rest
of the package without passing through here. Every refusal is a `ValueError` naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = [
    "INT64_MAX",
    "MAX_JSON_BYTES",
    "MAX_JSON_VALUES",
    "integer",
    "mapping",
    "names",
    "number",
    "parse_json",
    "show",
    "string",
    "string_map",
]

MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
# Values (containers, numbers, strings) one JSON document may hold. Python spends up to ~70 bytes
# on each (an empty object: 64), so 64 MiB of `[{},{},...]` would take 1.5 GB; with this bound
# a parse holds at most ~300 MB of objects plus its strings' text. An honest manifest of 10 000
# files with 100 block digests each holds about 1.1 million values.
MAX_JSON_VALUES = 1 << 22
INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- JSON


def parse_json(
    raw: bytes | bytearray | memoryview,
    *,
    what: str = "JSON",
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Parse `raw` as strict, bounded JSON and return the value; `what` names it in refusals.

    Refuses, with ValueError: more than `max_bytes` bytes, `MAX_JSON_VALUES` values or `max_depth`
    levels of nesting; anything but UTF-8 without a byte order mark; `NaN` and `Infinity`; numbers
    that overflow a float; duplicate object keys. Values are counted before parsing, to bound
    memory.
    """
    _check_value_count(raw, what, max_bytes, MAX_JSON_VALUES)
    if len(raw) > max_bytes:
        raise ValueError(f"{what} is {len(raw)} bytes, more than the {max_bytes} allowed")
    text = utf8_text(raw, what)
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise ValueError(f"{what} is nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    except ValueError as exc:  # from the hooks, or an integer with too many digits
        raise ValueError(f"{what}: {exc}") from None
    depth = nesting_depth(value, stop_above=max_depth)
    if depth > max_depth:
        raise ValueError(f"{what} is nested more than the {max_depth} levels allowed")
    return value


def _check_value_count(raw: bytes | bytearray | memoryview, what: str, max_bytes: int, max_values: int) -> None:
    """Refuse (ValueError) a document of over `max_values` values before `json.loads` builds them.

    Every value but the root follows a `[`, `,` or `:`. Counting those bytes gives an upper bound,
    exact once the strings are cut out. Linear time, no backtracking.
    """
    if len(raw) > max_bytes:
        return  # refused for its size by the caller
    data = raw if isinstance(raw, bytes | bytearray) else bytes(raw)
    if _separators(data) <= max_values:
        return
    # escapes first (`\\` then `\"`), so that every quote left delimits a string; then the strings
    outside = _STRING.sub(b"", data.replace(b"\\\\", b"").replace(b'\\"', b""))
    values = _separators(outside)
    if values > max_values:
        raise ValueError(f"{what} holds about {values} values, more than the {max_values} allowed")


_STRING = re.compile(rb'"[^"]*"')


def _separators(data: bytes | bytearray) -> int:
    return 1 + sum(data.count(byte) for byte in (b"[", b"{", b",", b":"))


def utf8_text(raw: bytes | bytearray | memoryview, what: str) -> str:
    """`raw` decoded as strict UTF-8 without a byte order mark; ValueError naming `what` if not."""
    data = bytes(raw)
    if data.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{what} starts with a byte order mark: it must be UTF-8 without one")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 (byte {exc.start}: {exc.reason})") from None


def nesting_depth(value: Any, stop_above: int | None = None) -> int:
    """Levels of list and object nesting of a parsed JSON value; stops counting past `stop_above`.

    It walks level by level, without recursion. Gathering each level by comprehension is several
    times faster than a node-by-node walk on millions of values.
    """
    level, depth = [value], 0
    while True:
        containers = [item for item in level if isinstance(item, dict | list)]
        if not containers:
            return depth
        depth += 1
        if stop_above is not None and depth > stop_above:
            return depth
        level = []
        for container in containers:
            level.extend(container.values() if isinstance(container, dict) else container)


def _refuse_constant(name: str):
    raise ValueError(f"non-finite JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {duplicate[:80]!r}")
    return result


# --------------------------------------------------------------------------- values


def integer(value: Any, where: str, *, low: int = 0, high: int = INT64_MAX) -> int:
    """`value` if it is an int (never a bool or float) in `[low, high]`; ValueError if not."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where} is {show(value)}, not an integer")
    if not low <= value <= high:
        raise ValueError(f"{where} is {show(value)}, outside [{low}, {high}]")
    return value


def number(value: Any, where: str, *, low: float = -math.inf, high: float = math.inf) -> float:
    """`value` if it is a finite int or float (never a bool) in `[low, high]`; ValueError if not."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{where} is {show(value)}, not a number")
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{where} is {show(value)}, outside [{low}, {high}]")
    return value


def string(value: Any, where: str, *, max_len: int = 4096, pattern: re.Pattern | None = None) -> str:
    """`value` if a str of at most `max_len` characters matching `pattern`; else ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"{where} is {show(value)}, not a string")
    if len(value) > max_len:
        raise ValueError(f"{where} is {len(value)} characters long, more than {max_len}")
    if pattern is not None and not pattern.fullmatch(value):
        raise ValueError(f"{where} is {show(value)}, which is not of the form {pattern.pattern}")
    return value


def mapping(value: Any, where: str) -> dict:
    """`value` if it is a JSON object (a dict); ValueError naming `where` otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {show(value)}, not a JSON object")
    return value


def string_map(value: Any, where: str, *, max_len: int = 4096) -> dict[str, str]:
    """`value` if it is a JSON object of strings to strings; ValueError if not.

    Safetensors' `__metadata__` is one.
    """
    for key, item in mapping(value, where).items():
        string(key, f"{where} key", max_len=max_len)
        string(item, f"{where}[{key[:40]!r}]", max_len=max_len)
    return value


def show(value: Any) -> str:
    """At most 60 characters of `value` as `repr` writes it, for a message.

    It is built piece by piece and stops at the limit. A value read from disk may be millions of
    elements wide, or an integer of thousands of digits that `repr` refuses.
    """
    out, size = [], 0
    for piece in _pieces(value):
        out.append(piece)
        size += len(piece)
        if size > 60:
            break
    text = "".join(out)
    return text if len(text) <= 60 else text[:57] + "..."


def names(items, limit: int = 8) -> str:
    """A list of names read from disk, for a message: the first `limit`, each cut by `show`.

    When there are more, it says how many there are in all.
    """
    items = list(items)
    shown = ", ".join(show(item) for item in items[:limit])
    return f"[{shown}]" if len(items) <= limit else f"[{shown}, ... ({len(items)} in all)]"


def _pieces(value: Any):
    """`repr(value)` as a stream of short strings (iterative: no recursion limit)."""
    stack = [_parts(value)]
    while stack:
        piece = next(stack[-1], None)
        if piece is None:
            stack.pop()
        elif isinstance(piece, str):
            yield piece
        else:  # a child to expand in place
            stack.append(_parts(piece[0]))


def _parts(value: Any):
    if isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield from (", " if index else "", (key,), ": ", (item,))
        yield "}"
    elif isinstance(value, list | tuple):
        yield "[" if isinstance(value, list) else "("
        for index, item in enumerate(value):
            yield from (", " if index else "", (item,))
        yield "]" if isinstance(value, list) else ",)" if len(value) == 1 else ")"
    elif isinstance(value, str):
        yield repr(value[:61])
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        yield f"<an integer of {value.bit_length()} bits>"
    else:
        yield repr(value)
