"""Build a Miles-like megatron training run on the tiny LoRA model, and step it deterministically.

The run is assembled from the real megatron-core pieces Miles uses: ``Float16Module`` (bf16),
``DistributedDataParallel``, ``get_megatron_optimizer`` (a ``ChainedOptimizer``: with the
distributed optimizer a dense child, plus an expert child when expert adapters exist; the other
kinds of children are built in ``sim/optimizers.py``) and an ``OptimizerParamScheduler``. Call only inside a harness worker (``cpu_intercepts.install()`` done
and a default process group up).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from miles_lora_ckpt.sim.model import SimConfig, SimLoraModel, transformer_config
from miles_lora_ckpt.sim.optimizers import build_optimizer, ddp_config


@dataclass
class SimRun:
    """One built run: ``model`` is the list of DDP chunks (one here), as Miles holds it."""

    config: SimConfig
    model: list
    optimizer: object
    scheduler: OptimizerParamScheduler

    @property
    def inner_model(self) -> SimLoraModel:
        """The unwrapped model (below DDP and Float16Module); its parameter names are stable."""
        module = self.model[0].module
        return module.module if isinstance(module, Float16Module) else module


def build_run(config: SimConfig) -> SimRun:
    """Initialise model parallelism if needed and build model, optimizer and scheduler.

    Raises ``sim.optimizers.NotBuildable`` when the running megatron-core cannot build the optimizer.
    """
    _ensure_model_parallel(config)
    # As megatron's initialize does; the weights themselves come from seeded_init, never this RNG.
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    mcfg = transformer_config(config)
    module = SimLoraModel(mcfg, config)
    if config.dtype == "bf16":
        module = Float16Module(mcfg, module)  # bf16 params; the optimizer keeps fp32 masters
    ddp = DistributedDataParallel(config=mcfg, ddp_config=ddp_config(config), module=module)
    optimizer = build_optimizer(config, [ddp], module.module if isinstance(module, Float16Module) else module)
    return SimRun(config=config, model=[ddp], optimizer=optimizer, scheduler=_scheduler(config, optimizer))


def teardown(run: SimRun | None = None) -> None:
    """Destroy megatron's model-parallel groups so the next ``build_run`` starts clean."""
    if run is not None:
        run.model.clear()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def _ensure_model_parallel(config: SimConfig) -> None:
    if dist.get_world_size() != config.world_size:
        raise ValueError(f"config.world_size={config.world_size}, job world size {dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if current == (config.tp, config.pp, config.ep):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        expert_model_parallel_size=config.ep,
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


def batch(config: SimConfig, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) micro-batch of one DP rank at one step: a function of seed, step, rank."""
    digest = hashlib.sha256(f"batch/{config.seed}/{step}/{dp_rank}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    shape = (config.micro_batch, config.hidden)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def train_step(run: SimRun, step: int) -> float:
    """One training iteration as megatron's train_step runs it; returns the DP-mean loss."""
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    # With pipeline stages, each stage trains on its own local data and loss (no activations are
    # sent between stages: the harness needs per-stage optimizers, not a pipelined schedule).
    stream = parallel_state.get_data_parallel_rank() + 1000 * parallel_state.get_pipeline_model_parallel_rank()
    inputs, target = batch(run.config, step, stream)
    if not parallel_state.is_pipeline_first_stage():  # Float16Module casts inputs on stage 0 only
        inputs = inputs.to(run.config.torch_dtype)
    output = run.model[0](inputs)
    loss = torch.nn.functional.mse_loss(output.float(), target)
    loss.backward()
    finalize_model_grads(run.model)  # DP reduce-scatter of grads (finish_grad_sync per chunk)
    update_successful, _grad_norm, _zeros = run.optimizer.step()
    if update_successful:
        run.scheduler.step(increment=1)
    return _global_mean(loss)


def _global_mean(loss: torch.Tensor) -> float:
    # Every TP rank of a DP replica holds the same loss, so the world mean is the DP mean.
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
