"""A LoRA training run built by the REAL Megatron-Bridge 0.6.2 from a tiny HF base (harness only).

`build_bridge_run(config)` does what a Miles LoRA run on Bridge does, on CPU over gloo:

1. `AutoBridge.from_hf_pretrained(hf_dir)` on a tiny Qwen2 or Llama written by `sim.hf_base` (no hub);
2. `to_megatron_provider(load_weights=True)`, with the local (non-TE) layer spec, every fusion off
   (rope and softmax fusions need TE or CUDA), fp32 params, the config's TP and PP sizes;
3. `provider.provide()` for this pipeline stage, then the provider's pre-wrap hooks (Bridge loads the
   HF weights into the megatron model there);
4. Bridge's own `LoRA(target_modules=[linear_qkv, linear_proj, linear_fc1, linear_fc2])`, which
   freezes the base and wraps those linears (`.adapter.linear_in` / `.adapter.linear_out`);
5. megatron's real `DistributedDataParallel` and `get_megatron_optimizer` (a DistributedOptimizer,
   Adam, fp32) and an `OptimizerParamScheduler`.

`bridge_train_step` trains on seeded token batches. With PP=1 it uses the model's own LM loss. With
PP=2 each stage trains on a local loss, as the rest of the harness does, without a pipelined
schedule: stage 0 its hidden states against a seeded target, the last stage the LM loss from a
seeded input hidden state.
`megatron_logits` runs a real forward pass (TP all-reduces, the PP hand-over by broadcast) and gives
every rank the full fp32 logits [batch, seq, vocab].

Needs `bridge_shims.install()` and `cpu_intercepts.install()` in this worker (call `setup()`), and
the Bridge tier on the path (`make tier-bridge`). Not for production code.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
FAMILIES = ("qwen2", "llama")


@dataclass(frozen=True)
class BridgeRunConfig:
    """One real-Bridge run: the HF base's family and size, the parallel layout, LoRA and training."""

    family: str = "qwen2"  # "qwen2" or "llama" (sim.hf_base.ARCHITECTURES)
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    num_layers: int = 2
    hidden: int = 64
    ffn_hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lr: float = 1e-2
    min_lr: float = 1e-3
    train_iters: int = 10
    seq_length: int = 8
    micro_batch: int = 2
    seed: int = 1234

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BridgeRunConfig:
        return cls(**data)

    def hf_config_kwargs(self) -> dict:
        """Keyword arguments for the HF config class of `family` (tiny, untied embeddings)."""
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn_hidden,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


@dataclass
class BridgeRun:
    """A built run: `model` is the list of DDP chunks (one per rank here), as Miles holds it."""

    config: BridgeRunConfig
    bridge: Any  # the real AutoBridge
    lora: Any  # Bridge's LoRA (a PEFT transform)
    model: list
    optimizer: Any
    scheduler: Any

    @property
    def inner_model(self):
        """The chunk below DDP (the megatron GPTModel with Bridge's LoRA wrappers)."""
        return self.model[0].module

    def named_parameters(self):
        """`(name, param)` of the model below DDP (what `sim.snapshot.snapshot` reads)."""
        return self.inner_model.named_parameters()


def setup() -> None:
    """Install the harness's CPU intercepts and the Bridge shims in this worker (idempotent)."""
    from miles_lora_ckpt_harness.sim import bridge_shims, cpu_intercepts

    cpu_intercepts.install()
    bridge_shims.install()


def build_hf_base(path: str | Path, config: BridgeRunConfig, *, seed: int = 7) -> Path:
    """The tiny seeded HF base of `config.family` at `path` (sim.hf_base)."""
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny

    return build_tiny(path, config.family, config.hf_config_kwargs(), seed=seed)


def build_bridge_run(config: BridgeRunConfig, hf_dir: str | Path) -> BridgeRun:
    """Build the run (steps 1-5 above) in this harness worker; model parallelism is (re)initialised."""
    setup()  # before anything imports megatron.bridge
    import torch
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft.lora import LoRA
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from miles_lora_ckpt_harness.sim.train import destroy_model_parallel, init_model_parallel

    if dist.get_world_size() != config.world_size:
        raise ValueError(f"config.world_size={config.world_size}, job world size {dist.get_world_size()}")
    initialized = parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    ) == (config.tp, config.pp)
    if not initialized:  # keep a layout the caller (e.g. the Miles stand-in's init) already set up
        destroy_model_parallel()
        init_model_parallel(tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    torch.manual_seed(config.seed)

    bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = config.tp
    provider.pipeline_model_parallel_size = config.pp
    provider.transformer_layer_spec = get_gpt_layer_local_spec()
    for flag in (
        "apply_rope_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "gradient_accumulation_fusion",
        "cross_entropy_loss_fusion",
        "persist_layer_norm",
    ):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    provider.params_dtype, provider.bf16, provider.fp16 = torch.float32, False, False
    provider.use_cpu_initialization = True
    provider.sequence_parallel = False
    provider.finalize()
    module = provider.provide(
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage()
    )
    chunks = provider.pre_wrap_hook([module]) if provider.pre_wrap_hook else [module]  # Bridge loads HF weights
    lora = LoRA(target_modules=list(TARGET_MODULES), dim=config.lora_rank, alpha=config.lora_alpha, dropout=0.0)
    chunks = lora(chunks, training=True)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=True
    )
    model = [DistributedDataParallel(config=provider, ddp_config=ddp, module=chunk) for chunk in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            min_lr=config.min_lr,
            weight_decay=0.01,
            bf16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        model,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr / 10,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=2,
        lr_decay_steps=config.train_iters,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=config.train_iters,
        wd_incr_style="constant",
    )
    return BridgeRun(config=config, bridge=bridge, lora=lora, model=model, optimizer=optimizer, scheduler=scheduler)


def _generator(config: BridgeRunConfig, step: int, stream: str):
    import torch

    digest = hashlib.sha256(f"bridge-batch/{config.seed}/{step}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def tokens(config: BridgeRunConfig, step: int, stream: str):
    """Seeded (input_ids, labels) [micro_batch, seq_length]: a function of seed, step and stream."""
    import torch

    generator = _generator(config, step, stream)
    ids = torch.randint(0, config.vocab, (config.micro_batch, config.seq_length + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _positions(config: BridgeRunConfig):
    import torch

    return torch.arange(config.seq_length).unsqueeze(0).expand(config.micro_batch, -1)


def bridge_train_step(run: BridgeRun, step: int, scheduler_increment: int = 1) -> float:
    """One training iteration (see the module docstring); returns the mean local loss over ranks.
    The scheduler advances by `scheduler_increment` (Miles counts samples: the global batch size)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = run.config
    chunk = run.model[0]
    chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    dp, pp = parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    inputs, labels = tokens(config, step, f"dp{dp}")
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    shape = (config.seq_length, config.micro_batch, config.hidden)
    generator = _generator(config, step, f"dp{dp}/pp{pp}/hidden")
    if not first:
        run.inner_model.set_input_tensor(torch.randn(shape, generator=generator))
    output = chunk(inputs if first else None, _positions(config), None, labels=labels if last else None)
    if last:
        loss = output.float().mean()
    else:
        loss = torch.nn.functional.mse_loss(output.float(), torch.randn(shape, generator=generator))
    loss.backward()
    finalize_model_grads(run.model)
    update_successful, _grad_norm, _zeros = run.optimizer.step()
    if update_successful:
        run.scheduler.step(increment=scheduler_increment)
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def megatron_logits(run: BridgeRun, input_ids):
    """The model's fp32 logits [batch, seq, vocab] for `input_ids` [batch, seq], on every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    config = run.config
    chunk = run.model[0]
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    hidden_shape = (input_ids.shape[1], input_ids.shape[0], config.hidden)
    with torch.no_grad():
        run.inner_model.eval()
        try:
            if config.pp == 1:
                logits = chunk(input_ids, positions, None)
            else:
                hidden = chunk(input_ids, positions, None) if first else torch.empty(hidden_shape)
                dist.broadcast(hidden.contiguous(), src=pp_ranks[0], group=pp_group)
                if last:
                    run.inner_model.set_input_tensor(hidden)
                    logits = chunk(None, positions, None)
                else:
                    logits = None
        finally:
            run.inner_model.train()
        if logits is not None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
            shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(shards, logits.contiguous(), group=tp_group)
            logits = torch.cat(shards, dim=-1).float()
        if config.pp > 1:
            full = logits if last else torch.empty(input_ids.shape[0], input_ids.shape[1], config.vocab)
            dist.broadcast(full, src=pp_ranks[-1], group=pp_group)
            logits = full
    return logits


def adapter_state(run: BridgeRun) -> dict:
    """This rank's LoRA parameters (Megatron names, clones) for bit-exact comparisons."""
    return {name: p.detach().clone() for name, p in run.inner_model.named_parameters() if ".adapter." in name}
