"""A multi-LoRA slot model for the harness and the Miles stand-in: several adapter slots on one base linear.

Miles' multi-LoRA trains several adapters at once on one frozen base model. Every adapted base
linear is a `MultiLoRALinear` holding one adapter per *slot*. An adapter (a named training run) is
registered into a free slot, trained at its own cadence, and retired, which frees the slot. This
module is that model, written from a description (never from Miles or Bridge code), with the real
megatron-core pieces Miles uses: `Float16Module`, `DistributedDataParallel` and Miles' per-slot
optimizer chain (one `get_megatron_optimizer` per slot under one `LayerWiseDistributedOptimizer`,
group tag `miles_multi_lora_slot`, `miles_slot_child_indices`; `sim.optimizers`). It imports no
Miles: the stand-in's `multi_lora_*` modules call it.

Parameter names follow Megatron-Bridge's LoRA wrapper, with the slot index in the adapter's name;
each layer is a Qwen2-shaped SwiGLU MLP (megatron names), so Bridge maps a slot onto an HF Qwen2
base (`hf_config_kwargs`: `mlp.gate_proj` / `up_proj` / `down_proj`)::

    decoder.layers.{i}.mlp.linear_fc1.to_wrap.weight                          frozen base [gate; up] (column parallel)
    decoder.layers.{i}.mlp.linear_fc1.adapter.adapters.{slot}.linear_in.weight   [rank, hidden]      (replicated)
    decoder.layers.{i}.mlp.linear_fc1.adapter.adapters.{slot}.linear_out.weight  [2*ffn/tp, rank]    (column parallel)
    decoder.layers.{i}.mlp.linear_fc2.adapter.adapters.{slot}.linear_in.weight   [rank, ffn/tp]      (row parallel)
    decoder.layers.{i}.mlp.linear_fc2.adapter.adapters.{slot}.linear_out.weight  [hidden, rank]      (replicated)

`expose_adapter_slot(model, slot)` (Bridge's `multi_lora_layers` helper, as the harness's Bridge
double provides it) shows one slot as a single-LoRA `.adapter` while it is open, which is how
Bridge's `export_adapter_weights` exports a slot.

A forward runs the base plus the *active* slot's adapter (`set_active_slot`; Miles routes each
sample to its adapter's slot, the stand-in trains one slot per forward). `train_slot_step` is one
optimizer step of one slot, as Miles' `step_adapter_slots` does it: the slot's children
prepare their grads, the grad norm is reduced over the world, clipped, the children step, then the
chain all-gathers the updated parameters. Co-tenant slots' adapters, masters and moments are not
touched. `SlotScheduler` is Miles' per-slot `OptimizerParamScheduler` over the slot's param groups.

An adapter's initial weights and its training data are functions of (seed, adapter name, step)
only, never of the slot it is in, so a run is reproducible whatever slot an adapter lands in.
"""

from __future__ import annotations

import hashlib
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from miles_lora_ckpt_harness.sim.model import DTYPES, DictConfig, _megatron_linear, _replicated_linear

MODEL = "multi-lora"
SLOT_IN_NAME = re.compile(r"\.adapter\.adapters\.(\d+)\.")


@dataclass
class MultiLoraSimConfig(DictConfig):
    """A harness run of the multi-LoRA slot model; two equal configs give bit-identical runs.

    Fields shared with `SimConfig` mean the same (`sim.train.build_run` builds either). The
    optimizer is always Miles' multi-LoRA chain: Adam per slot under one LayerWise optimizer.
    """

    model: str = MODEL
    world_size: int = 2
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    dtype: str = "bf16"
    optimizer: str = "adam"
    muon_scalar: str = "adam"
    distributed: bool | None = False
    layer_wise: bool = True
    slots: int = 2
    seed: int = 1234
    num_layers: int = 2
    hidden: int = 16
    ffn_hidden: int = 32
    lora_rank: int = 4
    lora_alpha: float = 4.0
    micro_batch: int = 4
    seq_length: int = 4
    lr: float = 1e-2
    min_lr: float = 1e-3
    lr_warmup_iters: int = 2
    train_iters: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0

    def __post_init__(self):
        if self.model != MODEL:
            raise ValueError(f"MultiLoraSimConfig.model must be {MODEL!r}")
        if self.tp not in (1, 2) or self.world_size % self.tp or self.ffn_hidden % self.tp:
            raise ValueError(f"tp must be 1 or 2 and divide world_size and ffn_hidden, got tp={self.tp}")
        if (self.ep, self.pp, self.cp, self.vpp) != (1, 1, 1, 1):
            raise ValueError("the multi-LoRA slot model runs with ep = pp = cp = vpp = 1 (Miles requires PP=1)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.optimizer != "adam" or self.distributed or not self.layer_wise:
            raise ValueError("Miles' multi-LoRA builds Adam per slot under a LayerWise optimizer")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")

    @property
    def uses_layer_wise(self) -> bool:
        return True

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def hf_config_kwargs(self) -> dict:
        """`transformers.Qwen2Config(**kwargs)` of an HF base whose MLPs have the slot model's shapes
        (gate/up [ffn, hidden], down [hidden, ffn]); attention and embeddings are never adapted."""
        return {
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn_hidden,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": self.hidden // 2,
            "vocab_size": 64,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
        }

    def slot_of_param(self, name: str) -> int:
        """The slot of an adapter parameter, from its name (`...adapter.adapters.{slot}...`)."""
        return slot_of_name(name)


def slot_of_name(name: str) -> int:
    match = SLOT_IN_NAME.search(name)
    if match is None:
        raise ValueError(f"{name} is not a slot adapter parameter")
    return int(match.group(1))


def slot_independent_name(name: str) -> str:
    """`...adapter.adapters.3.linear_in.weight` -> `...adapter.linear_in.weight` (as Bridge exposes one slot)."""
    return SLOT_IN_NAME.sub(".adapter.", name)


# --------------------------------------------------------------------------- the model


def _seeded_values(seed: int, name: str, shape, std: float) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * std


class SlotAdapter(torch.nn.Module):
    """One slot's LoRA factors on one base linear: `linear_out(linear_in(x))`."""

    def __init__(self, mcfg, config, parallel: str, in_size: int, out_size: int, name: str):
        super().__init__()
        rank, seed = config.lora_rank, config.seed
        if parallel == "column":  # in replicated, out split like the base output
            self.linear_in = _replicated_linear(in_size, rank, seed, f"{name}.linear_in")
            self.linear_out = _megatron_linear(mcfg, "column", rank, out_size, seed, f"{name}.linear_out")
        else:  # in split like the base input, out replicated
            self.linear_in = _megatron_linear(mcfg, "row", in_size, rank, seed, f"{name}.linear_in")
            self.linear_out = _replicated_linear(rank, out_size, seed, f"{name}.linear_out")
        self.parallel = parallel
        self.sizes = (in_size, out_size)

    def forward(self, x):
        if self.parallel == "column":
            delta, _ = self.linear_out(self.linear_in(x))
            return delta
        low_rank, _ = self.linear_in(x)
        return self.linear_out(low_rank)


class SlotAdapters(torch.nn.Module):
    """The adapters of every slot of one base linear (`adapters[slot]`)."""

    def __init__(self, adapters: list[SlotAdapter]):
        super().__init__()
        self.adapters = torch.nn.ModuleList(adapters)


class MultiLoRALinear(torch.nn.Module):
    """A frozen megatron base linear (`to_wrap`) plus the active slot's `scale * adapter(x)`."""

    def __init__(self, mcfg, config, name: str, parallel: str):
        super().__init__()
        # fc1 (column): hidden -> fused [gate; up] (2 * ffn); fc2 (row): ffn -> hidden
        sizes = (config.hidden, 2 * config.ffn_hidden) if parallel == "column" else (config.ffn_hidden, config.hidden)
        self.parallel = parallel
        self.to_wrap = _megatron_linear(mcfg, parallel, *sizes, config.seed, f"{name}.to_wrap")
        self.to_wrap.weight.requires_grad_(False)
        self.adapter = SlotAdapters(
            [SlotAdapter(mcfg, config, parallel, *sizes, f"{name}.slot{s}") for s in range(config.slots)]
        )
        self.scales = [config.lora_alpha / config.lora_rank] * config.slots
        self.active_slot: int | None = None

    def forward(self, x):
        out, _ = self.to_wrap(x)
        if self.active_slot is None:
            return out
        return out + self.scales[self.active_slot] * self.adapter.adapters[self.active_slot](x)


class SlotMLP(torch.nn.Module):
    """Qwen2's SwiGLU MLP in megatron's layout: each TP shard of fc1's output is [gate; up]."""

    def __init__(self, mcfg, config, index: int):
        super().__init__()
        self.linear_fc1 = MultiLoRALinear(mcfg, config, f"decoder.layers.{index}.mlp.linear_fc1", "column")
        self.linear_fc2 = MultiLoRALinear(mcfg, config, f"decoder.layers.{index}.mlp.linear_fc2", "row")

    def forward(self, x):
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(torch.nn.functional.silu(gate) * up)


class SlotLayer(torch.nn.Module):
    def __init__(self, mcfg, config, index: int):
        super().__init__()
        self.mlp = SlotMLP(mcfg, config, index)

    def forward(self, x):
        return x + self.mlp(x)


class SlotDecoder(torch.nn.Module):
    def __init__(self, mcfg, config, num_layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(SlotLayer(mcfg, config, i) for i in range(num_layers))


class MultiLoraSimModel(MegatronModule):
    """`num_layers` SlotLayers on a [sequence, batch, hidden] input (one model chunk: PP = 1)."""

    def __init__(self, mcfg, config: MultiLoraSimConfig):
        super().__init__(config=mcfg)
        self.decoder = SlotDecoder(mcfg, config, config.num_layers)
        self.pre_process = self.post_process = True
        self.share_embeddings_and_output_weights = False
        self.sim_config = config
        for slot in range(config.slots):  # every slot starts as "adapter slot{s}" would
            init_adapter_weights([self], slot, f"slot{slot}")

    def set_input_tensor(self, input_tensor):
        """Pipeline hook megatron wrappers forward to (PP = 1 here)."""

    def forward(self, x):
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def transformer_config(config: MultiLoraSimConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden,
        ffn_hidden_size=config.ffn_hidden,
        num_attention_heads=2,
        tensor_model_parallel_size=config.tp,
        pipeline_dtype=config.torch_dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=config.torch_dtype,
        bf16=config.dtype == "bf16",
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )


# --------------------------------------------------------------------------- slot operations


def _unwrap(chunk):
    module = chunk
    while hasattr(module, "module"):
        module = module.module
    return module


def multi_lora_linears(model) -> list[MultiLoRALinear]:
    chunks = model if isinstance(model, list | tuple) else [model]
    return [m for chunk in chunks for m in _unwrap(chunk).modules() if isinstance(m, MultiLoRALinear)]


def slot_parameters(model, slot: int) -> dict[str, torch.nn.Parameter]:
    """`{name: parameter}` of slot `slot`'s adapters (names below the model's wrappers), in model order."""
    chunks = model if isinstance(model, list | tuple) else [model]
    found = {}
    for chunk in chunks:
        for name, param in _unwrap(chunk).named_parameters():
            match = SLOT_IN_NAME.search(name)
            if match is not None and int(match.group(1)) == slot:
                found[name] = param
    return found


def set_active_slot(model, slot: int | None) -> None:
    for linear in multi_lora_linears(model):
        linear.active_slot = slot


def _tp_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of a full tensor, along the dimension where the shapes differ."""
    if full.shape == param.shape:
        return full
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for dim, (whole, part) in enumerate(zip(full.shape, param.shape, strict=True)):
        if whole != part:
            return full.narrow(dim, tp_rank * part, part)
    raise AssertionError("unreachable")


def init_adapter_weights(model, slot: int, adapter_name: str) -> None:
    """Give slot `slot` the initial weights of adapter `adapter_name`: a function of (seed, name) only.

    `linear_out` starts small but not zero, so an adapter matters from its first step.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    seed = _seed_of(model)
    for index, linear in enumerate(multi_lora_linears(model)):
        adapter = linear.adapter.adapters[slot]
        in_size, _ = adapter.sizes
        for part in ("linear_in", "linear_out"):
            param = getattr(adapter, part).weight
            rows, cols = param.shape
            split_rows = linear.parallel == "column" and part == "linear_out"
            split_cols = linear.parallel == "row" and part == "linear_in"
            full = (rows * (tp if split_rows else 1), cols * (tp if split_cols else 1))
            std = (1.0 if part == "linear_in" else 0.1) / math.sqrt(in_size)
            values = _seeded_values(seed, f"adapter/{adapter_name}/{index}/{part}", full, std)
            with torch.no_grad():
                param.data.copy_(_tp_slice(values, param).to(param.dtype))


def _seed_of(model) -> int:
    chunks = model if isinstance(model, list | tuple) else [model]
    return _unwrap(chunks[0]).sim_config.seed


def clear_adapter_slot(model, slot: int) -> None:
    """Zero slot `slot`'s adapter weights (retire)."""
    with torch.no_grad():
        for param in slot_parameters(model, slot).values():
            param.data.zero_()


def zero_adapter_slot_grads(model, slot: int) -> None:
    """Zero the slot's gradients (DDP's main_grad buffers and any .grad)."""
    for param in slot_parameters(model, slot).values():
        if getattr(param, "main_grad", None) is not None:
            param.main_grad.zero_()
        if param.grad is not None:
            param.grad = None


@contextmanager
def active_slot(model, slot: int):
    set_active_slot(model, slot)
    try:
        yield
    finally:
        set_active_slot(model, None)


@contextmanager
def expose_adapter_slot(model, slot: int):
    """While open, every MultiLoRALinear shows slot `slot`'s adapter as its single-LoRA `.adapter`
    (`...linear_fc1.adapter.linear_in.weight`): what Bridge's export of one slot walks. The slot
    model is restored on exit, whatever happens inside."""
    linears = multi_lora_linears(model)
    saved = [linear.adapter for linear in linears]
    try:
        for linear in linears:
            linear.adapter = linear.adapter.adapters[slot]
        yield
    finally:
        for linear, adapters in zip(linears, saved, strict=True):
            linear.adapter = adapters


# --------------------------------------------------------------------------- optimizer and scheduler


def slot_children(optimizer, slot: int) -> list:
    """Slot `slot`'s optimizer children (`miles_slot_child_indices`), in chain order."""
    return [optimizer.chained_optimizers[i] for i in optimizer.miles_slot_child_indices[slot]]


class SlotParamGroups:
    """The `.param_groups` of one slot's children: what Miles' per-slot scheduler drives."""

    def __init__(self, optimizer, slot: int):
        self.optimizer, self.slot = optimizer, slot

    @property
    def param_groups(self) -> list[dict]:
        return [group for child in slot_children(self.optimizer, self.slot) for group in child.param_groups]


def slot_scheduler(config, optimizer, slot: int, *, samples_per_step: int, num_step: int | None):
    """Megatron's `OptimizerParamScheduler` over one slot's groups; every count in samples, as Miles
    counts.

    `num_step` None: constant LR after warmup; else a cosine decay over `num_step * samples_per_step`.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = (num_step or 1) * samples_per_step
    return OptimizerParamScheduler(
        SlotParamGroups(optimizer, slot),
        init_lr=config.lr / 10,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_iters * samples_per_step,
        lr_decay_steps=max(decay, config.lr_warmup_iters * samples_per_step + 1),
        lr_decay_style="constant" if num_step is None else "cosine",
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )


@torch.no_grad()
def step_slot(optimizer, slot: int, clip_grad: float) -> float:
    """One optimizer step of slot `slot`'s children only (Miles' `step_adapter_slots`)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    children = slot_children(optimizer, slot)
    for child in children:
        child.prepare_grads()
    grads = []
    for child in children:  # megatron 0.19 renamed get_main_grads_for_grad_norm
        grads_of = getattr(child, "get_main_grads_for_grad_norm", None) or child.get_grads_for_grad_norm
        grads += grads_of()
    norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=None)  # summed over the world
    for child in children:
        params = child.get_parameters()
        if params and clip_grad > 0:
            clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=norm)
    for child in children:
        child.step_with_ready_grads()
    optimizer.allgather_params()
    return float(norm)


def batch(config, adapter_name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's (input, target) for adapter `adapter_name`'s step `step` (TP ranks share it)."""
    dp = parallel_state.get_data_parallel_rank()
    shape = (config.seq_length, config.micro_batch, config.hidden)
    inputs = _seeded_values(config.seed, f"batch/{adapter_name}/{step}/dp{dp}/in", shape, 1.0)
    target = _seeded_values(config.seed, f"batch/{adapter_name}/{step}/dp{dp}/target", shape, 1.0)
    return inputs, target


def train_slot_step(run, slot: int, adapter_name: str, step: int, scheduler=None, samples_per_step: int = 1) -> float:
    """Collective: one training step of adapter `adapter_name` (in slot `slot`) at its step `step`.

    Forward and backward with only this slot active, DDP's all-reduce, the slot's children step,
    its scheduler advances by `samples_per_step`. Returns the loss averaged over ranks.
    """
    import torch.distributed as dist
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = run.config
    for chunk in run.model:
        chunk.zero_grad_buffer()
    inputs, target = batch(config, adapter_name, step)
    with active_slot(run.model, slot):
        output = run.model[0](inputs.to(config.torch_dtype))
        loss = torch.nn.functional.mse_loss(output.float(), target)
        loss.backward()
    finalize_model_grads(run.model)
    step_slot(run.optimizer, slot, config.clip_grad)
    zero_adapter_slot_grads(run.model, slot)
    if scheduler is not None:
        scheduler.step(increment=samples_per_step)
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
