"""Stand-in of miles/backends/megatron_utils/lora/checkpoint.py (multi-LoRA v2), defects included.

`save_slot` publishes through `checkpoint_io` (staging `_tmp_<name>` cleared and reused, a
`_version_<name>_<uuid>` directory, the symlink `<name>` swapped): the shard writer of each
(tp, pp, ep) writes `adapter_megatron_tp{tp}_pp{pp}[_ep{ep}].pt`, every rank writes
`optim_rank{global_rank}.pt` with the slot's Adam state and group steps (no fp32 masters, no
scheduler). `load_slot` copies the adapter, refreshes the masters of the *whole chain* from bf16
(every co-tenant's too), then optionally loads this rank's optimizer file, asserting the same
world size. No manifest, no digests, no agreement.

Stand-in differences: reads use `torch.load(weights_only=True)`; collectives use tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from miles.backends.training_utils.checkpoint_io import write_checkpoint_dir

from miles_lora_ckpt.core import faults
from miles_lora_ckpt_harness.miles_standin.common import slot_stock as stock
from miles_lora_ckpt_harness.sim import multi_lora_model as slot_model


def save_slot(model, optimizer, slot: int, path: str) -> None:
    is_writer, _ = stock.adapter_shard_topology()
    tp, pp, ep = stock.my_coords()
    rank = dist.get_rank()

    def write(staging: Path) -> None:
        faults.point("before-write", rank)
        if is_writer:
            torch.save(stock.slot_state(model, slot), staging / stock.megatron_shard_name(tp, pp, ep, stock.ep_size()))
        faults.point("mid-write", rank)
        children = [child.optimizer.state_dict() for child in slot_model.slot_children(optimizer, slot)]
        torch.save({"world_size": dist.get_world_size(), "children": children}, staging / f"optim_rank{rank}.pt")
        faults.point("after-write", rank)

    write_checkpoint_dir(path, write)


def load_slot(model, optimizer, slot: int, path: str, load_optimizer: bool) -> None:
    path = Path(path)
    tp, pp, ep = stock.my_coords()
    shard = path / stock.megatron_shard_name(tp, pp, ep, stock.ep_size())
    loaded = stock.load_adapter(model, slot, torch.load(shard, map_location="cpu", weights_only=True))
    assert loaded > 0, f"no adapter tensor of {shard} matched slot {slot}"
    optimizer.reload_model_params()  # the whole chain: every co-tenant's masters from bf16
    if load_optimizer:
        state = torch.load(path / f"optim_rank{dist.get_rank()}.pt", map_location="cpu", weights_only=True)
        assert state["world_size"] == dist.get_world_size(), "optimizer state needs the same world size"
        for child, saved in zip(slot_model.slot_children(optimizer, slot), state["children"], strict=True):
            child.optimizer.load_state_dict(saved)
