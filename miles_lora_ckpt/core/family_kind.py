"""The optimizer child families a checkpoint records, as the manifest names them.

Every child of a saved optimizer chain belongs to one family (`megatron/optimizer_children`),
recorded as `optimizer_children.<i>.family` in the manifest. The values are the manifest's
strings: the Enum is a `StrEnum`, so JSON written and read is unchanged.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["FamilyKind"]


class FamilyKind(StrEnum):
    """One family of optimizer children (its manifest name)."""

    # DistributedOptimizer: element-wise shards of the grad buffers over the child's DP group.
    DISTRIBUTED = "distributed"
    # Float16OptimizerWithFloat16Params / FP32Optimizer: whole parameters, alike on all DP ranks.
    REPLICATED = "replicated"
    # Those two classes under a LayerWiseDistributedOptimizer: each whole parameter on one DP rank.
    LAYER_WISE = "layer-wise"

    @property
    def whole_parameter(self) -> bool:
        """Whether its files hold whole local parameters (`{name}.param` and state keys)."""
        return self is not FamilyKind.DISTRIBUTED

    @classmethod
    def parse(cls, value) -> FamilyKind | None:
        """The kind a manifest's `family` field names, or None for anything else."""
        try:
            return cls(value)
        except ValueError:
            return None
