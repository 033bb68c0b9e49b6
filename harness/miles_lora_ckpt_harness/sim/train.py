"""Build a Miles-like megatron training run on the tiny LoRA model, and step it deterministically.

The run is assembled from the real megatron-core pieces Miles uses: ``Float16Module`` (bf16),
``DistributedDataParallel``, ``get_megatron_optimizer`` (a ``ChainedOptimizer``: with the
distributed optimizer a dense child, plus an expert child when expert adapters exist; the other
kinds of children are built in ``sim/optimizers.py``) and an ``OptimizerParamScheduler``. Call
only inside a harness worker (``cpu_intercepts.install()`` done and a default process group up).

Model chunks follow megatron's ``get_model``. With a virtual pipeline (``vpp > 1``) every rank
builds ``vpp`` chunks (chunk i gets ``vp_stage=i``), each in its own ``Float16Module`` and
``DistributedDataParallel``, with bucketing disabled from the second chunk on. One
``get_megatron_optimizer`` call covers every chunk (``sim/optimizers.py``). Under context
parallelism megatron's DDP reduces dense grads over the data-and-context group and the distributed
optimizer shards over it.
"""

from __future__ import annotations

import gc
import hashlib
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from miles_lora_ckpt_harness.sim.layout import cp_positions
from miles_lora_ckpt_harness.sim.model import SimConfig, SimLoraModel, transformer_config
from miles_lora_ckpt_harness.sim.optimizers import build_optimizer, ddp_config


@dataclass
class SimRun:
    """One built run: ``model`` is the list of DDP chunks (``vpp`` of them), as Miles holds it."""

    config: SimConfig
    model: list
    optimizer: object
    scheduler: OptimizerParamScheduler

    @property
    def inner_models(self) -> list[SimLoraModel]:
        """Every chunk unwrapped (below DDP and Float16Module), in chunk order."""
        modules = [chunk.module for chunk in self.model]
        return [m.module if isinstance(m, Float16Module) else m for m in modules]

    @property
    def inner_model(self) -> SimLoraModel:
        """The first chunk unwrapped; its parameter names are stable."""
        return self.inner_models[0]

    def named_parameters(self):
        """``(name, param)`` of every chunk: plain names with one chunk, ``chunk{c}.``-prefixed with several."""
        several = len(self.model) > 1
        for index, module in enumerate(self.inner_models):
            for name, param in module.named_parameters():
                yield (f"chunk{index}.{name}" if several else name), param


def build_run(config: SimConfig) -> SimRun:
    """Initialise model parallelism if needed and build model chunks, optimizer and scheduler.

    Raises ``sim.optimizers.NotBuildable`` when the running megatron-core cannot build the optimizer.
    """
    _ensure_model_parallel(config)
    # As megatron's initialize does; the weights themselves come from seeded_init, never this RNG.
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    model = _build_model_chunks(config)
    optimizer = build_optimizer(config, model, [_unwrapped(chunk) for chunk in model])
    return SimRun(config=config, model=model, optimizer=optimizer, scheduler=_scheduler(config, optimizer))


def build_bucket_run(world_size: int, bucket_mib: float) -> tuple[SimRun, SimpleNamespace]:
    """A distributed bf16 LoRA run whose one DistributedOptimizer bucket is about `bucket_mib` MiB of
    fp32, after one training step, and the Miles-like args its saves take (the bench's MEM and
    ASYNC sections). A layer of hidden h, ffn 4h, LoRA rank r has two adapted linears:
    2*r*(h + 4h) = 10*h*r LoRA elements."""
    hidden, rank = 1024, 128
    layers = max(1, math.ceil(bucket_mib * 2**20 / 4 / (10 * hidden * rank)))
    config = SimConfig(
        world_size=world_size,
        dtype="bf16",
        adapters="dense",
        distributed=True,
        num_layers=layers,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        lora_rank=rank,
    )
    run = build_run(config)
    train_step(run, 0)
    return run, SimpleNamespace(lora_rank=rank, lora_alpha=float(rank), no_save_optim=False)


def _build_model_chunks(config: SimConfig) -> list:
    """As megatron's ``get_model``: one chunk per virtual stage, each in its own Float16Module and DDP."""
    chunks = []
    for index in range(config.vpp):
        mcfg, module = _build_module(config, vp_stage=index if config.vpp > 1 else None)
        if config.dtype == "bf16":
            module = Float16Module(mcfg, module)  # bf16 params; the optimizer keeps fp32 masters
        # megatron turns bucketing off from the second chunk on (its communication overlaps anyway)
        chunks.append(
            DistributedDataParallel(
                config=mcfg, ddp_config=ddp_config(config), module=module, disable_bucketing=index > 0
            )
        )
    return chunks


def config_from_dict(data: dict):
    """A `SimConfig`, or a `Qwen2SimConfig` when `data["model"] == "qwen2"` (the PEFT export model)."""
    if data.get("model") == "qwen2":
        from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

        return Qwen2SimConfig.from_dict(data)
    if data.get("model") == "multi-lora":
        from miles_lora_ckpt_harness.sim.multi_lora_model import MultiLoraSimConfig

        return MultiLoraSimConfig.from_dict(data)
    return SimConfig.from_dict(data)


def _build_module(config, vp_stage: int | None) -> tuple:
    """`(megatron config, module)` of one model chunk: the tiny LoRA model, the Qwen2-shaped one or the
    multi-LoRA slot model (`sim.multi_lora_model`)."""
    if getattr(config, "model", None) == "qwen2":
        from miles_lora_ckpt_harness.sim.qwen2_model import SimQwen2Model

        mcfg = config.transformer_config()
        return mcfg, SimQwen2Model(mcfg, config)
    if getattr(config, "model", None) == "multi-lora":
        from miles_lora_ckpt_harness.sim import multi_lora_model

        mcfg = multi_lora_model.transformer_config(config)
        return mcfg, multi_lora_model.MultiLoraSimModel(mcfg, config)
    mcfg = transformer_config(config)
    return mcfg, SimLoraModel(mcfg, config, vp_stage=vp_stage)


def _unwrapped(chunk) -> SimLoraModel:
    module = chunk.module
    return module.module if isinstance(module, Float16Module) else module


def teardown(run: SimRun | None = None) -> None:
    """Destroy megatron's model-parallel groups so the next ``build_run`` starts clean.

    The run's model, optimizer and scheduler are dropped (they hold the groups), and a garbage
    collection frees the groups' gloo threads and sockets at once rather than at some later cycle.
    """
    if run is not None:
        run.model.clear()
        run.optimizer = run.scheduler = None
    destroy_model_parallel()
    gc.collect()


# The process groups megatron's initialize_model_parallel made, destroyed with it. Megatron's own
# destroy_model_parallel only forgets them: torch keeps every group (and each gloo group's threads
# and sockets) until `dist.destroy_process_group(group)`, so a worker that builds many runs would
# grow by ~50 threads and ~90 descriptors per build at W=4 (issue 23 item 8).
_MEGATRON_GROUPS: list = []


def init_model_parallel(**kwargs) -> None:
    """`parallel_state.initialize_model_parallel(**kwargs)`, remembering the groups it creates so that
    `destroy_model_parallel` can free them."""
    before = set(dist.distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(**kwargs)
    _MEGATRON_GROUPS.extend(g for g in dist.distributed_c10d._world.pg_map if g not in before)


def destroy_model_parallel() -> None:
    """Megatron's `destroy_model_parallel`, then destroy every process group it had created."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    while _MEGATRON_GROUPS:
        group = _MEGATRON_GROUPS.pop()
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def _ensure_model_parallel(config: SimConfig) -> None:
    if dist.get_world_size() != config.world_size:
        raise ValueError(f"config.world_size={config.world_size}, job world size {dist.get_world_size()}")
    etp = getattr(config, "etp", None) or config.tp  # the Qwen2 and multi-LoRA models: megatron's default
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        if current == (config.tp, config.pp, config.ep, config.cp, config.vpp, etp):
            return
    destroy_model_parallel()
    init_model_parallel(
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        context_parallel_size=config.cp,
        expert_model_parallel_size=config.ep,
        # megatron's own expert-TP group (None: the TP size, its default); the expert linears split over it
        expert_tensor_parallel_size=etp,
    )


def _scheduler(config: SimConfig, optimizer) -> OptimizerParamScheduler:
    # Warmup from lr/10 then cosine decay: the LR differs at every step, and is never 0.
    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr / 10,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_iters,
        lr_decay_steps=config.train_iters,
        lr_decay_style="cosine",
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=config.train_iters,
        wd_incr_style="constant",
    )


def batch(config: SimConfig, step: int, stream: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole (input, target) micro-batch [seq_length, micro_batch, hidden]: a function of seed, step, stream."""
    digest = hashlib.sha256(f"batch/{config.seed}/{step}/{stream}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    shape = (config.seq_length, config.micro_batch, config.hidden)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def local_batch(config: SimConfig, step: int, vp_stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one chunk's micro-batch.

    Every DP replica, pipeline stage and model chunk trains on its own data (the stages on local
    losses: no activations travel between them, the harness needs per-stage optimizers, not a
    pipelined schedule). TP ranks of a replica see the same data; CP ranks of a replica see the
    same sequences and each keeps its own positions (megatron's load-balanced split).
    """
    dp, pp = parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    inputs, target = batch(config, step, f"dp{dp}/pp{pp}/vp{vp_stage}")
    positions = cp_positions(config.seq_length, config.cp, parallel_state.get_context_parallel_rank())
    keep = torch.tensor(positions, dtype=torch.long)
    return inputs.index_select(0, keep), target.index_select(0, keep)


def train_step(run: SimRun, step: int, *, scheduler_increment: int = 1) -> float:
    """One training iteration as megatron's train_step runs it; returns the mean loss over ranks.

    Each chunk's loss is the mean over this rank's tokens; megatron's DDP averages grads over the
    data-and-context-parallel group, so the update follows the mean over every token of every
    replica, whatever the CP size. The scheduler advances by `scheduler_increment` (Miles counts
    samples: its global batch size).
    """
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    loss = torch.zeros(())
    for vp_stage, chunk in enumerate(run.model):
        inputs, target = local_batch(run.config, step, vp_stage)
        output = chunk(inputs.to(run.config.torch_dtype))
        loss = loss + torch.nn.functional.mse_loss(output.float(), target)
    loss.backward()
    finalize_model_grads(run.model)  # DP x CP reduce-scatter of grads (finish_grad_sync per chunk)
    update_successful, _grad_norm, _zeros = run.optimizer.step()
    if update_successful:
        run.scheduler.step(increment=scheduler_increment)
    return _global_mean(loss)


def _global_mean(loss: torch.Tensor) -> float:
    # A deterministic summary of every rank's local loss (TP ranks of a replica hold the same one).
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
