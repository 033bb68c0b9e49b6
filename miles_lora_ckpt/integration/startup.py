"""Reject, before training starts, configurations whose LoRA checkpoints could not be saved.

Better to fail at step 0 with the flag to change than at the first save, hours in. Supported
optimizer children (`megatron.optimizer_children`): DistributedOptimizer (with its gloo DP group),
Float16OptimizerWithFloat16Params and FP32Optimizer, alone or under a LayerWiseDistributedOptimizer,
with whatever inner optimizer megatron builds (Adam, Lion, Muon and its scalar optimizer, ...).
"""

from __future__ import annotations

from miles_lora_ckpt.megatron.optimizer_children import DISTRIBUTED, SUPPORTED_CLASSES, leaf_children


class UnsupportedConfiguration(ValueError):
    """The run is configured in a way this plugin cannot checkpoint; the message says what to change."""


def validate_startup(args=None, optimizer=None) -> None:
    """Check Miles/Megatron args (a Namespace) and, once built, the optimizer. Raises with every problem."""
    problems = _arg_problems(args) if args is not None else []
    problems += _optimizer_problems(optimizer) if optimizer is not None else []
    if problems:
        raise UnsupportedConfiguration("miles-lora-ckpt cannot checkpoint this run:\n  - " + "\n  - ".join(problems))


def _arg_problems(args) -> list[str]:
    problems = []
    uses_distopt = getattr(args, "use_distributed_optimizer", False)
    gloo_off = getattr(args, "disable_gloo_process_groups", False) or not getattr(
        args, "enable_gloo_process_groups", True
    )
    if uses_distopt and gloo_off:
        problems.append(
            "the distributed optimizer's state is gathered over gloo, but gloo process groups are disabled: "
            "drop --disable-gloo-process-groups"
        )
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
        elif name == DISTRIBUTED and getattr(opt, "data_parallel_group_gloo", None) is None:
            problems.append(
                f"optimizer child {index} (DistributedOptimizer) has no gloo DP group: drop "
                "--disable-gloo-process-groups (for layer-wise Muon, build DDP without the distributed optimizer, "
                "as Miles does, so megatron puts every parameter under the LayerWise optimizer)"
            )
    return problems
