"""Model, optimizer, scheduler and train step of a stand-in Miles run, on the CPU harness.

`setup_model_and_optimizer` maps Miles' flags onto a harness config and builds the run with the real
megatron-core pieces (`sim.train.build_run`), then gives it Miles' scheduler (`get_optimizer_param_scheduler`:
every step count in samples). `train_one_step` is one optimizer step of a rollout; the data is a
function of (seed, global step, DP rank), so a resumed run sees the data an uninterrupted one saw.
`load_hf_base` stands in for the bridge-mode base-model load (`_load_checkpoint_hf`): the "HF
checkpoint" is a directory with a `config.json`, and the base weights are the run's seeded ones.

Which model a launch trains follows `--hf-checkpoint`, as in Miles' bridge mode, where Bridge builds
the Megatron model from the HF config:

- a `config.json` of a Qwen2 model (`architectures` holds `Qwen2ForCausalLM`, as `sim.hf_base`
  writes it, with the shapes of `sim.qwen2_model.Qwen2SimConfig`): the Qwen2-shaped harness model,
  whose adapters the Bridge double maps onto HF Qwen2 names (the PEFT export path).
  `--target-modules` takes Miles' spellings: HF names (`q_proj,k_proj,v_proj,o_proj,gate_proj,
  up_proj,down_proj`), Megatron names (`linear_qkv,linear_proj,linear_fc1,linear_fc2`) or
  `all-linear` (also the default); the model adapts either the attention linears or all of them.
  No experts, context parallelism or virtual pipelines.
- any other `config.json` (e.g. `{}`): the tiny LoRA model of `sim.model`; `--target-modules` picks
  dense (`linear_qkv,linear_proj`), expert (`linear_fc1,linear_fc2`) or both (the default).
  Megatron-LM's `--expert-tensor-parallel-size` (default: the TP size) splits the expert linears
  over megatron's expert-TP group. `--num-experts N` numbers N experts globally, N / EP per EP rank,
  so the model is the same at every EP size; without it, there is one expert per EP rank.
  `--num-layers` sets the layer count; without it, the fewest layers (at least 2) that give every
  pipeline and virtual-pipeline chunk the same number.
- after `use_real_bridge()` (the Bridge tier only): the REAL Megatron-Bridge 0.6.2 builds the model
  from `--hf-checkpoint`, a tiny Qwen2 or Llama (`sim.bridge_model`). It has Bridge's own LoRA on
  the four linears, fp32, and megatron's DistributedOptimizer with Adam, as Miles' bridge mode does.
The harness (and megatron) is imported inside the functions, so the stand-in's modules import with
torch alone, as Miles' `lora_utils` does.
"""

from __future__ import annotations

import json
from pathlib import Path

DENSE_TARGETS = ("linear_qkv", "linear_proj")
EXPERT_TARGETS = ("linear_fc1", "linear_fc2")
_RUNS: dict = {}  # id(model list) -> sim.train.SimRun (or sim.bridge_model.BridgeRun)
_REAL_BRIDGE = {"on": False}
BRIDGE_FAMILIES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


def use_real_bridge() -> None:
    """Build this process's models with the real Megatron-Bridge (`sim.bridge_model`); installs the
    Bridge shims (harness workers of the Bridge tier only)."""
    from miles_lora_ckpt_harness.sim import bridge_model

    bridge_model.setup()
    _REAL_BRIDGE["on"] = True


def bridge_config(args):
    """Miles' flags and --hf-checkpoint's config as a `sim.bridge_model.BridgeRunConfig`."""
    import torch.distributed as dist

    from miles_lora_ckpt_harness.sim.bridge_model import BridgeRunConfig

    hf = hf_config(args)
    family = next((BRIDGE_FAMILIES[a] for a in hf.get("architectures") or [] if a in BRIDGE_FAMILIES), None)
    if family is None:
        raise ValueError(f"--hf-checkpoint {args.hf_checkpoint}: the real-Bridge run builds {sorted(BRIDGE_FAMILIES)}")
    if args.bf16 or args.fp16:
        raise ValueError("the real-Bridge stand-in run is fp32: drop --bf16 / --fp16")
    if args.target_modules not in (None, "all-linear") or args.optimizer != "adam":
        raise ValueError("the real-Bridge stand-in run adapts all four linears (all-linear) with Adam")
    parallel = (args.expert_model_parallel_size, args.context_parallel_size, args.virtual_pipeline_model_parallel_size)
    moe = (getattr(args, "num_experts", None), getattr(args, "expert_tensor_parallel_size", None))
    if parallel not in ((1, 1, None), (1, 1, 1)) or moe != (None, None) or getattr(args, "num_layers", None):
        raise ValueError(
            "the real-Bridge stand-in run has no EP, expert-TP, experts, CP or virtual pipeline, and takes its "
            "layer count from --hf-checkpoint's config"
        )
    return BridgeRunConfig(
        family=family,
        world_size=dist.get_world_size(),
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        num_layers=int(hf["num_hidden_layers"]),
        hidden=int(hf["hidden_size"]),
        ffn_hidden=int(hf["intermediate_size"]),
        heads=int(hf["num_attention_heads"]),
        kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        vocab=int(hf["vocab_size"]),
        lora_rank=args.lora_rank,
        lora_alpha=float(args.lora_alpha),
        lr=args.lr,
        min_lr=args.min_lr,
        seed=args.seed,
    )


def adapter_kind(target_modules: str | None) -> str:
    """`--target-modules` -> the harness's adapter layout (dense, expert-only, mixed)."""
    names = set(target_modules.split(",")) if target_modules else set(DENSE_TARGETS + EXPERT_TARGETS)
    unknown = names - set(DENSE_TARGETS + EXPERT_TARGETS)
    if unknown:
        raise ValueError(f"--target-modules: the stand-in model has no {sorted(unknown)}")
    dense, expert = bool(names & set(DENSE_TARGETS)), bool(names & set(EXPERT_TARGETS))
    return "mixed" if dense and expert else ("dense" if dense else "expert-only")


QWEN2_ARCHITECTURE = "Qwen2ForCausalLM"
HF_TO_MEGATRON = {  # Miles' convert_target_modules_to_megatron for a Qwen2 decoder
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
QWEN2_LAYOUTS = {  # Megatron modules adapted -> Qwen2SimConfig.adapters
    frozenset({"linear_qkv", "linear_proj"}): "attention",
    frozenset({"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}): "all",
}


def hf_config(args) -> dict:
    """The `config.json` of `--hf-checkpoint` ({} when there is none to read)."""
    path = Path(args.hf_checkpoint or "") / "config.json"
    if not args.hf_checkpoint or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def qwen2_adapters(target_modules: str | None) -> str:
    """`--target-modules` of a Qwen2 run -> `Qwen2SimConfig.adapters` ("attention" or "all")."""
    if not target_modules or target_modules == "all-linear":
        return "all"
    modules = set()
    for name in target_modules.split(","):
        megatron = HF_TO_MEGATRON.get(name, name)
        if megatron not in set(HF_TO_MEGATRON.values()):
            raise ValueError(f"--target-modules: a Qwen2 decoder has no {name!r}")
        modules.add(megatron)
    layout = QWEN2_LAYOUTS.get(frozenset(modules))
    if layout is None:
        raise ValueError(
            f"--target-modules {target_modules}: the Qwen2-shaped stand-in model adapts the attention linears "
            f"(q_proj,k_proj,v_proj,o_proj) or all of them (all-linear), not {sorted(modules)}"
        )
    return layout


def sim_config(args):
    """Miles' flags (and --hf-checkpoint's config) as the harness's `SimConfig` or `Qwen2SimConfig`."""
    if args.lora_rank <= 0:
        raise ValueError("the Miles stand-in simulates LoRA runs only: pass --lora-rank")
    hf = hf_config(args)
    if QWEN2_ARCHITECTURE in (hf.get("architectures") or []):
        return _qwen2_config(args, hf)
    return _tiny_config(args)


def _qwen2_config(args, hf: dict):
    import torch.distributed as dist

    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    fixed = {"--num-experts": getattr(args, "num_experts", None)}
    fixed["--expert-tensor-parallel-size"] = getattr(args, "expert_tensor_parallel_size", None)
    fixed["--num-layers"] = getattr(args, "num_layers", None)
    if any(v is not None for v in fixed.values()):
        raise ValueError(
            f"{', '.join(k for k, v in fixed.items() if v is not None)}: the Qwen2-shaped model has no experts "
            "and takes its layer count from --hf-checkpoint's config"
        )
    expected = Qwen2SimConfig().hf_config_kwargs()
    differing = {k: (hf.get(k), v) for k, v in expected.items() if k in hf and hf.get(k) != v}
    if differing:
        raise ValueError(
            f"--hf-checkpoint {args.hf_checkpoint}: the Qwen2-shaped stand-in model has fixed shapes; "
            f"config.json differs in {differing} (found, expected): build it with sim.hf_base.build_tiny_qwen2"
        )
    return Qwen2SimConfig(
        world_size=dist.get_world_size(),
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        cp=args.context_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size or 1,
        dtype="bf16" if args.bf16 else "fp32",
        adapters=qwen2_adapters(args.target_modules),
        optimizer=args.optimizer,
        seed=args.seed,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
    )


def _tiny_config(args):
    import torch.distributed as dist

    from miles_lora_ckpt_harness.sim.layout import layers_for
    from miles_lora_ckpt_harness.sim.model import SimConfig

    return SimConfig(
        world_size=dist.get_world_size(),
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=getattr(args, "expert_tensor_parallel_size", None),
        num_experts=getattr(args, "num_experts", None) or 0,
        cp=args.context_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size or 1,
        num_layers=getattr(args, "num_layers", None)
        or layers_for(args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1),
        dtype="bf16" if args.bf16 else "fp32",
        adapters=adapter_kind(args.target_modules),
        optimizer=args.optimizer,
        seed=args.seed,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=float(getattr(args, "lora_dropout", 0.0) or 0.0),  # --lora-dropout (tiny model only)
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
    )


def initialize_model_parallel(args) -> None:
    """What Miles' initialize.init does first: megatron's parallel state (tp-cp-ep-dp-pp)."""
    from megatron.core import parallel_state

    from miles_lora_ckpt_harness.sim.train import init_model_parallel

    if not parallel_state.model_parallel_is_initialized():
        init_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        )


def setup_model_and_optimizer(args, role: str = "actor"):
    """`(model, optimizer, opt_param_scheduler)` as Miles' setup_model_and_optimizer returns them."""
    if _REAL_BRIDGE["on"]:
        from miles_lora_ckpt_harness.sim.bridge_model import build_bridge_run

        run = build_bridge_run(bridge_config(args), args.hf_checkpoint)
    else:
        from miles_lora_ckpt_harness.sim.train import build_run

        run = build_run(sim_config(args))
    run.scheduler = miles_scheduler(args, run.optimizer)
    _RUNS[id(run.model)] = run
    return run.model, run.optimizer, run.scheduler


def run_of(model):
    """The harness run behind a model list (for train steps and snapshots)."""
    return _RUNS[id(model)]


def train_iters(args) -> int:
    return args.num_rollout * args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size


def steps_per_rollout(args) -> int:
    steps = args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
    if steps < 1:
        raise ValueError("--rollout-batch-size x --n-samples-per-prompt must be at least --global-batch-size")
    return steps


def miles_scheduler(args, optimizer):
    """Miles' get_optimizer_param_scheduler: warmup and decay counted in samples (x global batch)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    args.train_iters = train_iters(args)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr / 10,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=(args.lr_decay_iters or args.train_iters) * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def train_one_step(args, rollout_id: int, step_id: int, model, optimizer, opt_param_scheduler) -> float:
    """Miles' train_one_step: zero grads, forward/backward, optimizer step, scheduler += samples."""
    from miles_lora_ckpt_harness.sim.train import train_step

    run = run_of(model)
    if run.optimizer is not optimizer or run.scheduler is not opt_param_scheduler:
        raise RuntimeError("train_one_step got an optimizer or scheduler its model was not built with")
    step = rollout_id * steps_per_rollout(args) + step_id
    if _REAL_BRIDGE["on"]:
        from miles_lora_ckpt_harness.sim.bridge_model import bridge_train_step

        return bridge_train_step(run, step, scheduler_increment=args.global_batch_size)
    return train_step(run, step, scheduler_increment=args.global_batch_size)


def has_loadable_ckpt(path: str | None) -> bool:
    """Miles' _has_loadable_ckpt: a non-empty directory."""
    return path is not None and Path(path).is_dir() and any(Path(path).iterdir())


def load_hf_base(model, optimizer, args, load_path: str) -> tuple[int, int]:
    """Miles' _load_checkpoint_hf: the bridge-mode base load, then the fp32 master refresh."""
    if args.megatron_to_hf_mode != "bridge":
        raise AssertionError("loading an HF checkpoint needs --megatron-to-hf-mode bridge")
    if not (Path(load_path) / "config.json").is_file():
        raise FileNotFoundError(f"{load_path} is not an HF checkpoint (no config.json)")
    # the frozen base weights are the run's seeded values: writing them again changes nothing
    if (args.bf16 or args.fp16) and optimizer is not None:
        optimizer.reload_model_params()
    return 0, 0
