"""Bounded parsing of everything read from disk: JSON with size and depth limits, checked values.

Every byte a checkpoint holds may be hostile or damaged. Nothing read from disk reaches the rest of
the package without passing through here: JSON is size- and depth-limited, refuses `NaN`,
`Infinity`, out-of-range numbers and duplicate keys, and values are checked for type and range
(`integer` refuses booleans, floats and anything outside its bounds). Every refusal is a
`ValueError` whose message names the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64
INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- JSON


def parse_json(
    raw: bytes | bytearray | memoryview,
    *,
    what: str = "JSON",
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Strict, bounded JSON: at most `max_bytes` bytes and `max_depth` levels of nesting, UTF-8
    (and only UTF-8: no byte order mark, no UTF-16 or UTF-32, which `json.loads` would otherwise
    detect and accept), no `NaN`/`Infinity` constants, no number that overflows a float, no
    duplicate object keys."""
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
    depth = nesting_depth(value)
    if depth > max_depth:
        raise ValueError(f"{what} is nested {depth} levels deep, more than the {max_depth} allowed")
    return value


def utf8_text(raw: bytes | bytearray | memoryview, what: str) -> str:
    """`raw` decoded as strict UTF-8 without a byte order mark; ValueError naming `what` otherwise."""
    data = bytes(raw)
    if data.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{what} starts with a byte order mark: it must be UTF-8 without one")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 (byte {exc.start}: {exc.reason})") from None


def nesting_depth(value: Any) -> int:
    """Levels of list/object nesting of a parsed JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in item)
    return deepest


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
    """An int (never a bool or a float) in `[low, high]`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where} is {show(value)}, not an integer")
    if not low <= value <= high:
        raise ValueError(f"{where} is {show(value)}, outside [{low}, {high}]")
    return value


def number(value: Any, where: str, *, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite int or float (never a bool) in `[low, high]`."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{where} is {show(value)}, not a number")
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{where} is {show(value)}, outside [{low}, {high}]")
    return value


def string(value: Any, where: str, *, max_len: int = 4096, pattern: re.Pattern | None = None) -> str:
    """A str of at most `max_len` characters, matching `pattern` when given."""
    if not isinstance(value, str):
        raise ValueError(f"{where} is {show(value)}, not a string")
    if len(value) > max_len:
        raise ValueError(f"{where} is {len(value)} characters long, more than {max_len}")
    if pattern is not None and not pattern.fullmatch(value):
        raise ValueError(f"{where} is {show(value)}, which is not of the form {pattern.pattern}")
    return value


def mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {show(value)}, not a JSON object")
    return value


def string_map(value: Any, where: str, *, max_len: int = 4096) -> dict[str, str]:
    """A JSON object of strings to strings (e.g. safetensors `__metadata__`)."""
    for key, item in mapping(value, where).items():
        string(key, f"{where} key", max_len=max_len)
        string(item, f"{where}[{key[:40]!r}]", max_len=max_len)
    return value


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
