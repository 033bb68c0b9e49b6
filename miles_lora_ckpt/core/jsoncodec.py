"""Lossless JSON for the non-tensor parts of optimizer and scheduler state.

JSON has no tuples and no tensors; optimizer param groups have both (`betas`, 0-d `step`). They
are tagged on the way out and restored on the way in, so a round trip gives back equal objects.
Anything else that is not plain JSON is refused loudly instead of being pickled.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FLOAT_TAG", "SCALAR_TAG", "TUPLE_TAG", "check_tags", "from_json", "to_json"]

# The tags of values JSON cannot hold; readers that check values without decoding use them too.
TUPLE_TAG, SCALAR_TAG, FLOAT_TAG = "__tuple__", "__scalar_tensor__", "__float__"
_TUPLE, _SCALAR = TUPLE_TAG, SCALAR_TAG
_TAGS = (TUPLE_TAG, SCALAR_TAG, FLOAT_TAG)

# The dtypes a 0-d tensor may be stored with (torch's names), and the JSON type its value must have.
SCALAR_DTYPES = {
    "float64": "number",
    "float32": "number",
    "float16": "number",
    "bfloat16": "number",
    "int64": "integer",
    "int32": "integer",
    "int16": "integer",
    "int8": "integer",
    "uint8": "integer",
    "bool": "boolean",
}

# The values each dtype holds exactly. A scalar outside them would decode to inf, wrap around
# (uint8 -1 -> 255) or raise in torch.tensor, so it is refused. Floats: torch.finfo(dtype).max;
# float64 holds every finite JSON number.
SCALAR_RANGES = {
    "float64": (-math.inf, math.inf),
    "float32": (-3.4028234663852886e38, 3.4028234663852886e38),
    "float16": (-65504.0, 65504.0),
    "bfloat16": (-3.3895313892515355e38, 3.3895313892515355e38),
    "int64": (-(2**63), 2**63 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int8": (-(2**7), 2**7 - 1),
    "uint8": (0, 2**8 - 1),
    "bool": (False, True),
}


def to_json(obj: Any, where: str = "state") -> Any:
    """`obj` as plain JSON, with tuples, 0-d tensors and non-finite floats tagged.

    A key that is not a string, or a value of any other type, raises TypeError naming `where`.
    """
    if isinstance(obj, bool) or obj is None or isinstance(obj, int | str):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return {FLOAT_TAG: repr(obj)}
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a string")
        return {k: to_json(v, f"{where}.{k}") for k, v in obj.items()}
    if _is_scalar_tensor(obj):
        return {_SCALAR: obj.item(), "dtype": str(obj.dtype).removeprefix("torch.")}
    raise TypeError(f"{where}: {type(obj).__name__} cannot be stored as JSON")


def from_json(obj: Any, where: str = "state") -> Any:
    """The value `to_json` was given; a malformed tagged value raises ValueError naming `where`.

    Every tagged value passes `check_tag` first, the check `verify` applies through `check_tags`.
    So nothing verify refuses is decoded.
    """
    if isinstance(obj, list):
        return [from_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        tag = check_tag(obj, where)
        if tag == _TUPLE:
            return tuple(from_json(v, f"{where}[{i}]") for i, v in enumerate(obj[_TUPLE]))
        if tag == FLOAT_TAG:
            return float(obj[FLOAT_TAG])
        if tag == _SCALAR:
            import torch

            return torch.tensor(obj[_SCALAR], dtype=getattr(torch, obj["dtype"]))
        return {k: from_json(v, f"{where}.{k}") for k, v in obj.items()}
    return obj


def check_tag(obj: dict, where: str) -> str | None:
    """Which tag the JSON object `obj` is, or None for a plain object.

    An object holding a tag key but not exactly that tag's shape raises ValueError naming `where`.
    The shapes: `{"__tuple__": [...]}`, `{"__float__": "nan" | "inf" | "-inf"}`, and
    `{"__scalar_tensor__": value, "dtype": one of SCALAR_DTYPES}`. A scalar's value must be of its
    dtype's kind and within `SCALAR_RANGES`.
    """
    tags = [t for t in _TAGS if t in obj]
    if not tags:
        return None
    tag = tags[0]
    if tag == _TUPLE and set(obj) == {_TUPLE} and isinstance(obj[_TUPLE], list):
        return tag
    if tag == FLOAT_TAG and set(obj) == {FLOAT_TAG} and obj[FLOAT_TAG] in ("nan", "inf", "-inf"):
        return tag
    if tag == _SCALAR and set(obj) == {_SCALAR, "dtype"}:
        dtype, value = obj["dtype"], obj[_SCALAR]
        kind = SCALAR_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if kind is None:
            raise ValueError(f"{where} is a scalar tensor of dtype {_show(dtype)}, not one of {sorted(SCALAR_DTYPES)}")
        if not _is_kind(value, kind):
            raise ValueError(f"{where} is a scalar tensor of dtype {dtype} holding {_show(value)}, not a {kind}")
        low, high = SCALAR_RANGES[dtype]
        if not low <= value <= high:
            raise ValueError(
                f"{where} is a scalar tensor of dtype {dtype} holding {_show(value)}, outside [{low}, {high}] "
                "(the values that dtype holds)"
            )
        return tag
    raise ValueError(f"{where} is a malformed {tag} value {_show(obj)}")


def check_tags(value: Any, where: str = "state") -> None:
    """`check_tag` on every JSON object anywhere in `value`, without recursion; ValueError."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            check_tag(item, path)
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == "integer" else isinstance(value, int | float)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_scalar_tensor(obj: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, torch.Tensor) and obj.dim() == 0
