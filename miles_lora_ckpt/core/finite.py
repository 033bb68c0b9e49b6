"""Whether a tensor holds only finite values, in one vectorised pass and no temporary.

Every floating value a save writes or a load installs is checked, so the check is on the hot path.
`torch.isfinite(t).all()` builds a boolean tensor of `t`'s size; a sum reads `t` once. The core
imports torch only when a tensor is checked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["all_finite"]


def all_finite(tensor: torch.Tensor) -> bool:
    """True if every element of `tensor` (any floating dtype, shape or strides) is finite.

    NaN and Inf propagate through IEEE addition, so one finite sum proves the whole tensor finite.
    Only a non-finite sum, which may also be an overflow, pays for the element-wise check. An empty
    tensor is finite. Raises nothing of its own.
    """
    if tensor.numel() == 0:
        return True
    if math.isfinite(tensor.sum().item()):
        return True
    import torch

    return bool(torch.isfinite(tensor).all())
