"""Stand-in of miles/backends/megatron_utils/multi_lora_utils.py (multi-LoRA v1), defects included.

Per adapter, `{save}/checkpoints/step_{N}/adapter_megatron_tp{tp}_pp{pp}[_ep{ep}].pt`, staged in
`_tmp_step_{N}`. As written in Miles: the staging directory depends only on N and is
reused (`exist_ok=True`), so a crashed attempt's files are promoted by a later one; an existing
`step_N` is removed before the staging directory replaces it; only the global writer syncs;
`find_latest_checkpoint` scans on each rank and raises on a stray `step_foo`; `_register_adapter`
asserts rank-locally; no optimizer or scheduler state is saved, and retiring or registering an
adapter refreshes every co-tenant's fp32 masters from bf16 (`reload_model_params`).

Stand-in differences: no Megatron-Bridge, so no `adapter_model.safetensors` (a warning, as the
single-LoRA stand-in does); reads use `torch.load(weights_only=True)`; collectives use tensors;
`faults.point` marks where the harness may SIGKILL a rank (before-write, mid-write, after-write).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from miles.backends.megatron_utils.multi_lora_scheduler import drop_slot_scheduler, install_slot_scheduler

from miles_lora_ckpt.core import faults
from miles_lora_ckpt_harness.miles_standin.common import multi_lora as common
from miles_lora_ckpt_harness.miles_standin.common import slot_stock as stock
from miles_lora_ckpt_harness.miles_standin.common.slot_stock import (  # noqa: F401 - as Miles has them here
    adapter_shard_topology,
    megatron_shard_name,
    zero_optimizer_state_for_adapter,
)
from miles_lora_ckpt_harness.sim.multi_lora_model import clear_adapter_slot, zero_adapter_slot_grads  # noqa: F401 - Bridge/MLO

log = logging.getLogger("miles.stand-in")


def all_megatron_checkpoints_exist(step_dir: Path, shard_names) -> bool:
    return all((Path(step_dir) / name).exists() for name in shard_names)


def find_latest_checkpoint(ckpt_dir: Path) -> tuple[Path | None, int]:
    """Each rank scans on its own: the newest `step_N` holding every expected shard."""
    _, coords = adapter_shard_topology()
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        return None, 0
    ep = stock.ep_size()
    expected = [megatron_shard_name(tp, pp, e, ep) for tp, pp, e in coords]
    tp, pp, e = stock.my_coords()
    mine = megatron_shard_name(tp, pp, e, ep)
    candidates = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_")]
    for step_dir in sorted(candidates, key=lambda p: int(p.name.split("_")[1]), reverse=True):  # ValueError on step_foo
        if all_megatron_checkpoints_exist(step_dir, expected):
            return step_dir / mine, int(step_dir.name.split("_")[1])
    return None, 0


def slice_lora_to_rank(hf_name: str, tensor: torch.Tensor, adapter_rank: int) -> torch.Tensor:
    dim = tensor.ndim - 2 if "lora_A" in hf_name else tensor.ndim - 1
    kept = tensor.narrow(dim, 0, adapter_rank)
    rest = tensor.narrow(dim, adapter_rank, tensor.shape[dim] - adapter_rank)
    assert rest.numel() == 0 or not rest.any(), f"{hf_name}: padded adapter rank is not zero"
    return kept


def save_multi_lora_checkpoints(args, model, adapter_steps: Mapping[str, int], adapters: Mapping[str, object]):
    is_shard_writer, _ = adapter_shard_topology()
    tp, pp, ep = stock.my_coords()
    is_global_writer = is_shard_writer and tp == pp == ep == 0
    rank = dist.get_rank()
    for name, adapter in adapters.items():
        config = adapter.config
        if config.save is None:
            continue
        step = int(adapter_steps[name])
        final_dir = Path(config.save) / "checkpoints" / f"step_{step}"
        tmp_dir = Path(config.save) / "checkpoints" / f"_tmp_step_{step}"
        if is_shard_writer:
            tmp_dir.mkdir(parents=True, exist_ok=True)  # reused as it is: stale files stay
        dist.barrier()
        faults.point("before-write", rank)
        if is_shard_writer:
            torch.save(
                stock.slot_state(model, adapter.slot), tmp_dir / megatron_shard_name(tp, pp, ep, stock.ep_size())
            )
        faults.point("mid-write", rank)
        log.warning("no Megatron-Bridge in the Miles stand-in: adapter_model.safetensors is not written")
        if is_global_writer:
            (tmp_dir / "adapter_config.json").write_text(
                json.dumps({"peft_type": "LORA", "r": config.rank, "lora_alpha": config.alpha})
            )
            os.sync()
        dist.barrier()
        if is_global_writer:
            if final_dir.exists():
                shutil.rmtree(final_dir)  # a window with no step_N
            faults.point("after-write", rank)
            os.replace(tmp_dir, final_dir)
        dist.barrier()


def _register_adapter(adapter, model) -> int:
    step, loaded = 0, 0
    if adapter.config.save is not None:
        ckpt, step = find_latest_checkpoint(Path(adapter.config.save) / "checkpoints")
        if ckpt is not None:
            state = torch.load(ckpt, map_location="cpu", weights_only=True)
            loaded = stock.load_adapter(model, adapter.slot, state)
            assert loaded > 0, f"no adapter tensor of {ckpt} matched slot {adapter.slot}"  # rank-local
    stock.init_adapter_slot(
        model, adapter.slot, adapter.name, adapter.config.rank, adapter.config.alpha, fresh=not loaded
    )
    return step


def _deregister_adapter(adapter, args, model, optimizer) -> None:
    if args.save_interval:
        step = common.controller().adapter_step(adapter.name)
        save_multi_lora_checkpoints(args, model, {adapter.name: step}, {adapter.name: adapter})  # even if step_N exists
    clear_adapter_slot(model, adapter.slot)
    zero_optimizer_state_for_adapter(optimizer, model, adapter.slot)
    zero_adapter_slot_grads(model, adapter.slot)
    drop_slot_scheduler(optimizer, adapter.slot)
    optimizer.reload_model_params()  # every co-tenant's masters from bf16


def load_adapters(args, model, optimizer, adapters) -> int:
    stock.barrier()
    steps = {}
    for adapter in adapters:
        step = _register_adapter(adapter, model)
        install_slot_scheduler(args, optimizer, adapter, step)
        steps[adapter.name] = step
    stock.barrier()
    optimizer.reload_model_params()
    for name, step in steps.items():
        if step > 0:
            common.controller().set_adapter_step(name, step)
    return len(steps)


def cleanup_adapters(args, model, optimizer, adapters) -> int:
    stock.barrier()
    for adapter in adapters:
        _deregister_adapter(adapter, args, model, optimizer)
    stock.barrier()
    return len(adapters)


def save_due_adapter_checkpoints(args, model) -> bool:
    due = []
    if dist.get_rank() == 0 and args.save_interval:
        for adapter in common.controller().adapters.values():
            config = adapter.config
            if adapter.step > 0 and adapter.step % args.save_interval == 0 and config.save is not None:
                if not (Path(config.save) / "checkpoints" / f"step_{adapter.step}").exists():
                    due.append(adapter.name)
    due = stock.broadcast_json(due)
    if not due:
        return False
    adapters = {name: common.controller().adapters[name] for name in due}
    save_multi_lora_checkpoints(args, model, {n: a.step for n, a in adapters.items()}, adapters)
    return True
