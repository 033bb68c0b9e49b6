"""Miles' launch flags (the subset the stand-in runs on) and its argument validation.

`build_parser` rejects unknown flags, as Miles' parser does: plugins cannot add
flags. `validate` reproduces `miles_validate_args`' checkpoint-related overrides: in bridge
mode, a `--load` without Megatron's `latest_checkpointed_iteration.txt` is replaced by the base
model (`--ref-load` or `--hf-checkpoint`) and `start_rollout_id` is forced to 0; raw mode does the
same and also sets `no_load_optim`, `no_load_rng` and `finetune`.

Stand-in simplifications: parameters are bf16 with `--bf16` and fp32 otherwise (Miles forces
`bf16 = not fp16`; `--fp16` is refused); the optimizer is always megatron's DistributedOptimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


def build_parser(gloo_dest: str) -> argparse.ArgumentParser:
    """`gloo_dest`: the args attribute of `--disable-gloo-process-groups` in this Miles version."""
    parser = argparse.ArgumentParser(prog="train.py", allow_abbrev=False, description="Miles stand-in")
    add = parser.add_argument
    # plugins
    add("--custom-megatron-init-path", default=None)
    add("--custom-megatron-post-save-hook-path", default=None)
    # checkpoints
    add("--load", default=None)
    add("--save", default=None)
    add("--save-interval", type=int, default=None)
    add("--save-hf", default=None, help="directory pattern with {rollout_id}")
    add("--async-save", action="store_true")
    add("--no-save-optim", action="store_true")
    add("--no-load-optim", action="store_true")
    add("--no-load-rng", action="store_true")
    add("--no-save-rng", action="store_true")
    add("--finetune", action="store_true")
    add("--ckpt-step", type=int, default=None)
    add(
        "--use-checkpoint-opt-param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
    )
    add("--override-opt-param-scheduler", action="store_true")
    add("--disable-gloo-process-groups", dest=gloo_dest, action="store_false")
    add("--non-persistent-ckpt-type", default=None, choices=("global", "local", "in_memory"))
    add("--use-fault-tolerance", action="store_true")
    add("--ft-components", nargs="+", default=None, help="FT components, e.g. train rollout")
    add("--start-rollout-id", type=int, default=None)
    add("--hf-checkpoint", default=None)
    add("--ref-load", default=None)
    add("--ref-ckpt-step", type=int, default=None)
    add("--megatron-to-hf-mode", choices=("raw", "bridge"), default="raw")
    add("--keep-old-actor", action="store_true")
    add("--use-kl-loss", action="store_true", help="loads the reference model (with_ref)")
    # LoRA
    add("--lora-rank", type=int, default=0)
    add("--lora-alpha", type=float, default=16.0)
    add("--lora-dropout", type=float, default=0.0)
    add(
        "--target-modules",
        default=None,
        help="comma-separated Megatron (linear_qkv,...) or, for a Qwen2 --hf-checkpoint, HF names (q_proj,...), "
        "or all-linear",
    )
    add("--lora-adapter-path", default=None)
    add("--multi-lora-n-adapters", type=int, default=0)
    add("--multi-lora-config", default=None, help="stand-in only: JSON list of adapters (common/multi_lora.py)")
    # optimizer and schedule
    add("--optimizer", choices=("adam", "lion"), default="adam")
    add("--lr", type=float, default=1e-2)
    add("--min-lr", type=float, default=1e-3)
    add("--lr-warmup-iters", type=int, default=1)
    add("--lr-decay-iters", type=int, default=None)
    add("--lr-decay-style", default="cosine")
    add("--weight-decay", type=float, default=0.01)
    add("--clip-grad", type=float, default=1.0)
    add("--seed", type=int, default=1234)
    add("--use-distributed-optimizer", action="store_true")
    add("--use-precision-aware-optimizer", action="store_true")
    add("--optimizer-cpu-offload", action="store_true")
    add("--stream-optimizer-state-to-disk", action="store_true")
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")
    # parallelism
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--expert-model-parallel-size", type=int, default=1)
    # Megatron-LM's: the expert linears' tensor-parallel size (None: the TP size, as Megatron-LM sets it)
    add("--expert-tensor-parallel-size", type=int, default=None)
    # Megatron-LM's MoE expert count (None: the stand-in's one expert per EP rank; N: N experts numbered
    # globally, N / EP per EP rank, the same model at every EP size)
    add("--num-experts", type=int, default=None)
    # Megatron-LM's layer count (None: the stand-in's fewest layers, at least 2, that give every
    # pipeline / virtual-pipeline chunk the same number; the Qwen2-shaped model takes its config's)
    add("--num-layers", type=int, default=None)
    add("--context-parallel-size", type=int, default=1)
    add("--virtual-pipeline-model-parallel-size", type=int, default=None)
    # rollouts
    add("--num-rollout", type=int, required=True)
    add("--rollout-batch-size", type=int, default=4)
    add("--n-samples-per-prompt", type=int, default=2)
    add("--global-batch-size", type=int, default=4)
    # the rollout manager's data source (common/rollout.py; without --prompt-data no rollout side runs)
    add("--data-source-path", default="miles.rollout.data_source.RolloutDataSourceWithBuffer")
    add("--rollout-function-path", default="miles.rollout.sglang_rollout.generate_rollout")
    add("--prompt-data", default=None)
    add("--input-key", default="input")
    add("--label-key", default=None)
    add("--disable-rollout-global-dataset", dest="rollout_global_dataset", action="store_false")
    add("--rollout-shuffle", action="store_true")
    add("--rollout-seed", type=int, default=42)
    add("--over-sampling-batch-size", type=int, default=None)
    add("--partial-rollout", action="store_true")
    return parser


def parse(gloo_dest: str, add_custom_arguments=None) -> argparse.Namespace:
    """Miles' `parse_args(add_custom_arguments=None)`: the command line is `sys.argv` (see `command_line`);
    `add_custom_arguments(parser)` may add flags, as Miles' parser hook does."""
    parser = build_parser(gloo_dest)
    if add_custom_arguments is not None:
        add_custom_arguments(parser)
    return parser.parse_args(sys.argv[1:])


@contextlib.contextmanager
def command_line(argv: list[str]):
    """`sys.argv` is `train.py <argv>` inside the block (Miles' entry points parse sys.argv)."""
    saved, sys.argv = sys.argv, ["train.py", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def validate(args) -> None:
    """Miles' checks and overrides that touch checkpoints (bridge and raw mode)."""
    if args.fp16:
        raise ValueError("the Miles stand-in does not simulate --fp16")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval requires --save")
    if args.custom_megatron_post_save_hook_path is not None and args.save is None:
        raise ValueError("--custom-megatron-post-save-hook-path requires --save")
    if args.use_fault_tolerance and "train" in (args.ft_components or ()):
        args.non_persistent_ckpt_type = "local"  # Miles' in-memory checkpoint for the train FT heal path
    if args.multi_lora_n_adapters > 0:
        validate_multi_lora_args(args)
        return
    lora = args.lora_rank > 0 or args.lora_adapter_path is not None
    if lora and args.megatron_to_hf_mode != "bridge":
        raise ValueError("LoRA (non-Inkling) requires --megatron-to-hf-mode bridge")
    args.use_distributed_optimizer = True  # set_default_megatron_args; the harness has no other
    has_tracker = args.load is not None and os.path.exists(os.path.join(args.load, MEGATRON_TRACKER))
    if has_tracker:
        return
    if args.megatron_to_hf_mode == "bridge":
        args.load = args.ref_load or args.hf_checkpoint
    else:
        args.no_load_optim = args.no_load_rng = args.finetune = True
        args.load = args.ref_load
        if args.ref_ckpt_step is not None:
            args.ckpt_step = args.ref_ckpt_step
    args.start_rollout_id = 0  # unconditional: overrides --start-rollout-id


def validate_multi_lora_args(args) -> None:
    """Miles' `validate_multi_lora_args`, as far as the stand-in runs multi-LoRA."""
    if args.lora_rank <= 0:
        raise ValueError("multi-LoRA needs --lora-rank > 0")
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("multi-LoRA requires PP == 1")
    if args.optimizer != "adam":
        raise ValueError("multi-LoRA requires --optimizer adam")
    args.megatron_to_hf_mode = "bridge"
    args.use_distributed_optimizer = False  # set_default_megatron_args


def should_run_periodic_action(
    rollout_id: int,
    interval: int | None,
    num_rollout_per_epoch: int | None = None,
    num_rollout: int | None = None,
) -> bool:
    """Miles' save cadence (miles/utils/misc.py; the signature of the real wheel's, compared in
    tests/test_real_miles.py): every `interval` rollouts, at an epoch boundary, and the last rollout."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)
