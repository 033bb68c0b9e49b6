"""Lossless JSON for the non-tensor parts of optimizer and scheduler state.

JSON has no tuples and no tensors; optimizer param groups have both (`betas`, 0-d `step`). They
are tagged on the way out and restored on the way in, so a round trip gives back equal objects.
Anything else that is not plain JSON is refused loudly instead of being pickled.
"""

from __future__ import annotations

import math
from typing import Any

# The tags of values JSON cannot hold (readers that check values without decoding use them too).
TUPLE_TAG, SCALAR_TAG, FLOAT_TAG = "__tuple__", "__scalar_tensor__", "__float__"
_TUPLE, _SCALAR = TUPLE_TAG, SCALAR_TAG


def to_json(obj: Any, where: str = "state") -> Any:
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


def from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {_TUPLE}:
            return tuple(from_json(v) for v in obj[_TUPLE])
        if set(obj) == {FLOAT_TAG}:
            return float(obj[FLOAT_TAG])
        if set(obj) == {_SCALAR, "dtype"}:
            import torch

            dtype = getattr(torch, str(obj["dtype"]), None)
            if not isinstance(dtype, torch.dtype) or not isinstance(obj[_SCALAR], int | float | bool):
                raise ValueError(f"bad scalar tensor {str(obj)[:80]}")
            return torch.tensor(obj[_SCALAR], dtype=dtype)
        return {k: from_json(v) for k, v in obj.items()}
    return obj


def _is_scalar_tensor(obj: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, torch.Tensor) and obj.dim() == 0
