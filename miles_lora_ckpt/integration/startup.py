"""Reject, before training starts, configurations whose LoRA checkpoints could not be saved.

Better to fail at step 0 with the flag to change than at the first save, hours in.
`validate_startup` checks what any caller of the savers needs (args and, once built, the
optimizer); `validate_miles_launch` adds what a Miles launch with the init hook needs.
"""

from __future__ import annotations

from pathlib import Path

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
    # megatron's switch is `enable_gloo_process_groups`, renamed `use_gloo_process_groups` (contract §10.1)
    gloo_off = (
        getattr(args, "disable_gloo_process_groups", False)
        or not getattr(args, "enable_gloo_process_groups", True)
        or not getattr(args, "use_gloo_process_groups", True)
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


def validate_miles_launch(args, config) -> None:
    """The init hook's checks: `validate_startup`'s plus what a Miles launch adds. Raises with every problem."""
    problems = _arg_problems(args) + _miles_problems(args, config)
    if problems:
        raise UnsupportedConfiguration("miles-lora-ckpt cannot checkpoint this run:\n  - " + "\n  - ".join(problems))


def _miles_problems(args, config) -> list[str]:
    from miles_lora_ckpt.integration.resume import save_root

    problems = []
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        problems.append(
            "--non-persistent-ckpt-type local (Miles' in-memory fault-tolerance checkpoint) cannot hold a LoRA "
            "optimizer state (stock Miles loses it silently): drop the flag; a relaunch resumes from disk"
        )
    if (getattr(args, "multi_lora_n_adapters", 0) or 0) > 0:
        problems.append(
            "--multi-lora-n-adapters: multi-LoRA runs are not covered by this version of miles-lora-ckpt; "
            "remove --custom-megatron-init-path for them"
        )
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
