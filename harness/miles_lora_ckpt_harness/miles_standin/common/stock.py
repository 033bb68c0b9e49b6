"""Stock Miles' single-LoRA checkpoint I/O, defects included.

Per global rank: `adapter_megatron_rank{r}.pt` (a pickle of `{wrapped-chunk param name: tensor}`)
and `training_state_rank{r}.pt` (`{"iteration", "optimizer": optimizer.state_dict(),
"opt_param_scheduler"}`). What that state_dict holds for megatron's DistributedOptimizer is the
defect: no fp32 masters, no moments; loading it gives `torch.empty` moments, and nothing refreshes
the masters after the adapter copy. A stub optimizer child makes `state_dict()` raise after the
adapter file is written. Stock Miles' PEFT export (a pickled `adapter_model.bin` under names PEFT
does not load) is not run: the stand-in logs the warning stock Miles logs when its
export fails, and goes on, as stock Miles does.

Stand-in differences: reads use `torch.load(weights_only=True)` (Miles unpickles the training state;
this project never does, and that state loads without it). `faults.point` marks where the harness
may SIGKILL a rank during a stock save (before-write, mid-write, after-write), for the demo's
negative control; Miles has no such points.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from miles_lora_ckpt.core import faults

log = logging.getLogger("miles.stand-in")


def is_adapter_param_name(name: str) -> bool:
    """Miles' `_is_adapter_param_name` (Megatron-side adapter names)."""
    return "lora_" in name or (".adapter." in name and ("linear_in" in name or "linear_out" in name))


def is_lora_model(model) -> bool:
    """Miles' `is_lora_model`: reads `chunk.module` unguarded, as Miles does."""
    for chunk in model:
        if hasattr(chunk.module, "peft_config"):
            return True
        if any("lora_" in name or "adapter" in name for name, _ in chunk.named_parameters()):
            return True
    return False


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def adapter_state(model) -> dict[str, torch.Tensor]:
    """`{name: param.data.cpu()}` over every chunk; a later chunk overwrites an equal name, as in
    Miles."""
    state = {}
    for chunk in model:
        for name, param in chunk.named_parameters():
            if is_adapter_param_name(name):
                state[name] = param.data.cpu()
    return state


def write_rank_files(save_dir: Path, model, optimizer, scheduler, iteration, *, with_optimizer: bool) -> None:
    """Every rank: its adapter pickle, the (skipped) PEFT export, its training-state pickle."""
    me = rank()
    faults.point("before-write", me)
    torch.save(adapter_state(model), save_dir / f"adapter_megatron_rank{me}.pt")
    faults.point("mid-write", me)
    try:
        raise RuntimeError("the Miles stand-in does not run stock Miles' PEFT export (it pickles adapter_model.bin)")
    except Exception as exc:  # noqa: BLE001 - stock Miles logs and goes on
        log.warning("HF PEFT export failed, continuing: %s", exc)
    if optimizer is not None:
        state = {"iteration": iteration}
        if with_optimizer:
            state["optimizer"] = optimizer.state_dict()  # stub child: AttributeError here, adapter already written
        state["opt_param_scheduler"] = scheduler.state_dict() if scheduler is not None else None
        torch.save(state, save_dir / f"training_state_rank{me}.pt")
    faults.point("after-write", me)


def read_adapter_shard(adapter_dir: Path) -> dict | None:
    """This rank's `adapter_megatron_rank{r}.pt`, else the legacy tp/pp name; None if neither exists."""
    from megatron.core import parallel_state

    native = adapter_dir / f"adapter_megatron_rank{rank()}.pt"
    if not native.exists():
        tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        legacy = adapter_dir / f"adapter_megatron_tp{tp}_pp{pp}.pt"
        if not legacy.exists():
            return None
        log.warning("using legacy adapter shard %s (only valid when EP<=TP)", legacy.name)
        native = legacy
    return torch.load(native, map_location="cpu", weights_only=True)


def copy_adapter(model, state: dict) -> None:
    """`param.data.copy_` by name; missing or unexpected names are ignored, as Miles does."""
    for chunk in model:
        for name, param in chunk.named_parameters():
            if name in state:
                param.data.copy_(state[name].to(param.device))


def read_training_state(adapter_dir: Path) -> dict | None:
    path = adapter_dir / f"training_state_rank{rank()}.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def apply_training_state(state: dict, optimizer, scheduler, *, load_optimizer: bool = True):
    """`_load_training_state`'s effect: optimizer.load_state_dict, scheduler.load_state_dict, iteration."""
    if load_optimizer and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])  # DistributedOptimizer: torch.empty moments
    if scheduler is not None and state.get("opt_param_scheduler") is not None:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    return state.get("iteration")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# What the shapes' `save_lora_checkpoint` and `load_lora_adapter` do; each shape's LoRA module
# keeps Miles' signatures (and calls `_load_training_state` through its own global where Miles does).


def save_in_place(model, save_dir: str, optimizer, scheduler, iteration) -> str:
    """lora-utils-2026-08: every rank creates `save_dir` and writes into it; `--no-save-optim` is
    ignored (PR #3083)."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)  # every rank
    barrier()
    write_rank_files(save_dir, model, optimizer, scheduler, iteration, with_optimizer=True)
    barrier()
    return str(save_dir)


def save_published(model, args, save_dir: str, optimizer, scheduler, iteration) -> str:
    """lora-package-2026-09 and later: written through the shape's checkpoint_io (staging, version
    directory, symlink); `--no-save-optim` drops only the optimizer entry."""
    from miles.backends.training_utils.checkpoint_io import write_checkpoint_dir

    with_optimizer = not getattr(args, "no_save_optim", False)
    Path(save_dir).parent.mkdir(parents=True, exist_ok=True)

    def write_shards(staging: Path) -> None:
        write_rank_files(staging, model, optimizer, scheduler, iteration, with_optimizer=with_optimizer)

    write_checkpoint_dir(save_dir, write_shards)
    return str(save_dir)


def load_adapter(model, adapter_path: str, *, follow_symlink: bool, peft_hint: bool) -> Path | None:
    """`load_lora_adapter`'s first half: this rank's shard copied into the model (no
    reload_model_params(): the masters stay stale). The adapter directory, or None with Miles'
    warning. `follow_symlink`: lora-package-2026-09 on, the directory is resolved through the
    version symlink; `peft_hint`: lora-utils-2026-08 names an HF PEFT adapter it cannot import."""
    adapter_dir = Path(adapter_path)
    if not adapter_dir.exists():
        log.warning("LoRA adapter path %s does not exist", adapter_path)
        return None
    if follow_symlink:
        adapter_dir = adapter_dir.resolve()
    state = read_adapter_shard(adapter_dir)
    if state is None:
        if peft_hint and (adapter_dir / "adapter_model.bin").exists():
            log.warning("HF PEFT adapter import is not implemented: %s", adapter_dir)
        else:
            log.warning("no LoRA adapter shard in %s", adapter_dir)
        return None
    copy_adapter(model, state)
    return adapter_dir


def load_training_state(adapter_dir: Path, optimizer, scheduler, load_optimizer: bool = True) -> int | None:
    """`_load_training_state`: nothing without an optimizer or a training-state file; else its iteration."""
    if optimizer is None:
        return None
    state = read_training_state(Path(adapter_dir))
    if state is None:
        return None
    return apply_training_state(state, optimizer, scheduler, load_optimizer=load_optimizer)
