"""Reject, before training starts, configurations whose LoRA checkpoints could not be saved.

Better to fail at step 0 with the flag to change than at the first save, hours in.
"""

from __future__ import annotations

from miles_lora_ckpt.megatron.optimizer_state import is_stub, optimizer_children


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
    for index, child in enumerate(optimizer_children(optimizer)):
        if is_stub(child):
            continue
        name = type(child).__name__
        if getattr(child, "_nvme_state_store", None) is not None:
            problems.append(f"optimizer child {index} streams its state to NVMe; Miles forbids that with LoRA too")
        elif not all(hasattr(child, attr) for attr in ("gbuf_ranges", "model_param_group_index_map")):
            problems.append(
                f"optimizer child {index} is a {name}, not megatron's DistributedOptimizer: "
                "add --use-distributed-optimizer"
            )
        elif getattr(child, "data_parallel_group_gloo", None) is None:
            problems.append(f"optimizer child {index} has no gloo DP group: drop --disable-gloo-process-groups")
        elif getattr(getattr(child, "config", None), "use_precision_aware_optimizer", False):
            problems.append(f"optimizer child {index} is precision-aware: drop --use-precision-aware-optimizer")
    return problems
