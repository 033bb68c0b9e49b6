"""Refuse, before training starts, configurations whose LoRA checkpoints could not be saved.

Better to fail at step 0 with the flag to change than at the first save, hours in.
`validate_startup` checks what any caller of the savers needs; `validate_miles_launch` adds what a
Miles launch with the init hook needs. The supported optimizer children are in docs/optimizers.md.
"""

from __future__ import annotations

from pathlib import Path

from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.megatron.optimizer_children import DISTRIBUTED, SUPPORTED_CLASSES, leaf_children
from miles_lora_ckpt.megatron.optimizer_children.distributed import dp_group

__all__ = [
    "UnsupportedConfiguration",
    "validate_startup",
    "validate_miles_launch",
]


class UnsupportedConfiguration(MilesLoraCkptError, ValueError):
    """The run is configured in a way this plugin cannot checkpoint; the message says what to change."""


def validate_startup(args=None, optimizer=None, model=None) -> None:
    """Check Miles/Megatron args (a Namespace) and, once built, the optimizer and the model chunks
    (DDP-wrapped, as Miles holds them). Raises with every problem."""
    problems = _arg_problems(args) if args is not None else []
    problems += _optimizer_problems(optimizer) if optimizer is not None else []
    problems += _replica_problems(model, optimizer) if model is not None and optimizer is not None else []
    if problems:
        raise UnsupportedConfiguration("miles-lora-ckpt cannot checkpoint this run:\n  - " + "\n  - ".join(problems))


def _arg_problems(args) -> list[str]:
    problems = []
    # --disable-gloo-process-groups is fine: the savers run no collective on megatron's gloo groups
    # (consensus makes its own gloo group; DistributedOptimizer slices are written per DP rank)
    if getattr(args, "use_precision_aware_optimizer", False):
        problems.append(
            "--use-precision-aware-optimizer keeps masters inside the optimizer in a scaled form this plugin "
            "does not save: drop the flag"
        )
    if getattr(args, "optimizer_cpu_offload", False):
        problems.append("--optimizer-cpu-offload (HybridDeviceOptimizer) is not supported: drop the flag")
    return problems


def _optimizer_problems(optimizer) -> list[str]:
    problems = []
    for child in leaf_children(optimizer):
        if child.is_stub:
            continue
        index, opt, name = child.index, child.optimizer, child.class_name
        inner = type(getattr(opt, "optimizer", None)).__name__
        if getattr(opt, "_nvme_state_store", None) is not None:
            problems.append(f"optimizer child {index} streams its state to NVMe; Miles forbids that with LoRA too")
        elif name not in SUPPORTED_CLASSES or (name == DISTRIBUTED and child.layer_wise):
            problems.append(
                f"optimizer child {index} is a {name} (inner {inner}): supported are DistributedOptimizer, "
                "Float16OptimizerWithFloat16Params and FP32Optimizer (alone or under a LayerWiseDistributedOptimizer)"
            )
        elif inner == "HybridDeviceOptimizer":
            problems.append(f"optimizer child {index} offloads to the CPU: drop --optimizer-cpu-offload")
        elif getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False):
            problems.append(f"optimizer child {index} is precision-aware: drop --use-precision-aware-optimizer")
        elif name == DISTRIBUTED and dp_group(opt) is None:
            problems.append(
                f"optimizer child {index} (DistributedOptimizer) has no data-parallel group to shard over "
                "(megatron 0.19's scalar optimizer beside a layout-based LayerWise one): for layer-wise Muon, "
                "build DDP without the distributed optimizer, as Miles does"
            )
    return problems


def _replica_problems(model, optimizer) -> list[str]:
    """Non-distributed children while DDP reduce-scatters: every DP rank steps different gradients.

    megatron 0.19 builds Lion and Muon as Float16/FP32 children even with
    --use-distributed-optimizer. DDP built for the distributed optimizer reduces each gradient only
    on its own shard, so the DP replicas of masters and moments drift apart, and the saver refuses
    to pick one of them.
    """
    chunks = model if isinstance(model, list | tuple) else [model]
    if not any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks):
        return []
    replicated = [
        c for c in leaf_children(optimizer) if not c.is_stub and not c.layer_wise and c.class_name != DISTRIBUTED
    ]
    if not replicated:
        return []
    names = sorted({f"{c.class_name} ({type(getattr(c.optimizer, 'optimizer', None)).__name__})" for c in replicated})
    return [
        f"megatron built non-distributed optimizer children {names} while DDP reduce-scatters gradients for a "
        "distributed optimizer: every DP rank would step on its own partial gradients; build DDP with "
        "use_distributed_optimizer=False for this optimizer (Miles does for Muon)"
    ]


def validate_miles_launch(args, config, multi_lora: str | None = None) -> None:
    """The init hook's checks: `validate_startup`'s plus what a Miles launch adds. Raises with every problem.

    `multi_lora`: the multi-LoRA shape the plugin bound ("v1", "v2"), or None when the running Miles
    has no multi-LoRA functions the plugin knows (then `--multi-lora-n-adapters` is refused)."""
    problems = _arg_problems(args) + _miles_problems(args, config, multi_lora)
    if problems:
        raise UnsupportedConfiguration("miles-lora-ckpt cannot checkpoint this run:\n  - " + "\n  - ".join(problems))


def _multi_lora_problems(args, config, multi_lora: str | None) -> list[str]:
    if multi_lora is None:
        return [
            "--multi-lora-n-adapters: this Miles has neither multi-LoRA v1's multi_lora_utils (save_multi_lora_"
            "checkpoints, find_latest_checkpoint, _register_adapter, load_adapters, _deregister_adapter) nor v2's "
            "lora/checkpoint.py (save_slot, load_slot) with signatures the plugin knows: its per-adapter saves "
            "would be unprotected; remove --custom-megatron-init-path for this run, or upgrade miles-lora-ckpt"
        ]
    problems = []
    if multi_lora == "v1" and not getattr(args, "save_interval", None):
        problems.append(
            "--multi-lora-n-adapters without --save-interval: Miles v1 saves no adapter (not even when one is "
            "retired); set --save-interval"
        )
    if getattr(args, "use_distributed_optimizer", False):
        problems.append(
            "--use-distributed-optimizer with multi-LoRA: Miles builds per-slot children without it; drop the flag"
        )
    return problems


def _async_save_problems(args, config) -> list[str]:
    """`save.async` covers single-LoRA saves without a PEFT export (see savers.single_lora.async_save)."""
    if not config["save.async"]:
        return []
    problems = []
    if config["export.peft"]:
        problems.append(
            "save.async = true with export.peft = true: the PEFT export runs over the live model and cannot be "
            "taken asynchronously; set one of them to false"
        )
    if (getattr(args, "multi_lora_n_adapters", 0) or 0) > 0:
        problems.append("save.async = true with --multi-lora-n-adapters: slot saves are synchronous; set it to false")
    return problems


def _train_ft(args) -> bool:
    """`--use-fault-tolerance --ft-components train`: Miles' validation (radixark/miles 31f1ca961a94
    and later) then sets `non_persistent_ckpt_type = "local"` itself, without the user's flag."""
    components = getattr(args, "ft_components", None) or ()
    if isinstance(components, str):
        components = components.replace(",", " ").split()
    return "train" in components


def _in_memory_flags(args) -> str:
    if _train_ft(args):
        fault = "--use-fault-tolerance " if getattr(args, "use_fault_tolerance", False) else ""
        return f"{fault}--ft-components train (Miles turns it into --non-persistent-ckpt-type local)"
    return "--non-persistent-ckpt-type local"


def _in_memory_remedy(args) -> str:
    if _train_ft(args):
        return "drop 'train' from --ft-components (or drop --use-fault-tolerance)"
    return "drop the flag"


def _miles_problems(args, config, multi_lora: str | None = None) -> list[str]:
    from miles_lora_ckpt.integration.resume import save_root

    problems = []
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        problems.append(
            f"{_in_memory_flags(args)} (Miles' in-memory fault-tolerance checkpoint) cannot hold a LoRA "
            f"optimizer state (stock Miles loses it silently): {_in_memory_remedy(args)}; a relaunch resumes "
            "from disk"
        )
    if (getattr(args, "lora_rank", 0) or 0) > 0 and getattr(args, "megatron_to_hf_mode", None) == "raw":
        problems.append(
            "--megatron-to-hf-mode raw with --lora-rank: Miles' native LoRA (miles_plugins/lora, PR #1792) keeps "
            "its adapters and optimizer state in megatron-core dist_checkpointing (<adapter dir>/torch_dist), "
            "which miles-lora-ckpt does not save or resume from (it only warm-starts adapter weights from one); use --megatron-to-hf-mode bridge, or remove "
            "--custom-megatron-init-path for this run"
        )
    if (getattr(args, "multi_lora_n_adapters", 0) or 0) > 0:
        problems += _multi_lora_problems(args, config, multi_lora)
    problems += _async_save_problems(args, config)
    if getattr(args, "stream_optimizer_state_to_disk", False):
        problems.append("--stream-optimizer-state-to-disk keeps the optimizer state outside the optimizer: drop it")
    adapter, save = getattr(args, "lora_adapter_path", None), getattr(args, "save", None)
    if adapter and save:
        adapter_path, root = Path(adapter).resolve(), save_root(config, save).resolve()
        if adapter_path == Path(save).resolve() or adapter_path == root or root in adapter_path.parents:
            problems.append(
                f"--lora-adapter-path {adapter} points into --save: the plugin resumes from --load by itself; "
                "--lora-adapter-path names the initial adapter only (drop it, or point it at that adapter)"
            )
    return problems
