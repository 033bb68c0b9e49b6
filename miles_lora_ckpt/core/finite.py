"""Whether a tensor holds only finite values, in one vectorised pass and no temporary.

Every floating value a load installs, and every one a save writes, is checked finite. The check
runs over every byte of every adapter, master and moment, so it is on the load's hot path:
`torch.isfinite(t).all()` builds a boolean tensor of `t`'s size and reads it back, where a sum
reads `t` once. The core imports torch only when a tensor is checked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """True if every element of `tensor` (any floating dtype, any shape or strides) is finite.

    A sum is finite only if every term is (NaN and Inf propagate through IEEE addition), so one
    finite sum proves the whole tensor finite. Only a non-finite sum, which may also be an overflow
    of finite values, pays for the exact element-wise check. An empty tensor is finite.
    """
    if tensor.numel() == 0:
        return True
    if math.isfinite(tensor.sum().item()):
        return True
    import torch

    return bool(torch.isfinite(tensor).all())
