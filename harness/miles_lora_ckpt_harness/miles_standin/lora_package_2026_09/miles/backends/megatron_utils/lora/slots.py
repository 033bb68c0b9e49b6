"""Stand-in of miles/backends/megatron_utils/lora/slots.py (multi-LoRA v2): slot primitives.

The v1 helpers moved here: `megatron_shard_name`, `adapter_shard_topology` (cached in the module
global `_shard_topology` of `common.slot_stock`), `zero_optimizer_state_for_adapter`,
`slice_lora_to_rank`; `create_multi_lora_instance(args)` builds the slot model and Miles' per-slot
optimizer chain on the CPU harness.
"""

from __future__ import annotations

import torch

from miles_lora_ckpt_harness.miles_standin.common import multi_lora as common
from miles_lora_ckpt_harness.miles_standin.common.slot_stock import (  # noqa: F401 - the shape's names
    adapter_shard_topology,
    megatron_shard_name,
    zero_optimizer_state_for_adapter,
)


def slice_lora_to_rank(hf_name: str, tensor: torch.Tensor, adapter_rank: int) -> torch.Tensor:
    dim = tensor.ndim - 2 if "lora_A" in hf_name else tensor.ndim - 1
    rest = tensor.narrow(dim, adapter_rank, tensor.shape[dim] - adapter_rank)
    assert rest.numel() == 0 or not rest.any(), f"{hf_name}: padded adapter rank is not zero"
    return tensor.narrow(dim, 0, adapter_rank)


def create_multi_lora_instance(args):
    """`(model, optimizer)`: the slot model with `--multi-lora-n-adapters` slots and its per-slot chain."""
    return common.setup_model_and_optimizer(args)
