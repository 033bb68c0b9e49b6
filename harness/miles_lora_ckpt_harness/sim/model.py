"""A tiny LoRA-style megatron model for the CPU harness, and the config that describes a run.

Every layer has frozen base linears (megatron ``ColumnParallelLinear`` / ``RowParallelLinear``)
and trainable adapter factors named ``lora_A`` / ``lora_B``, e.g.
``layers.0.linear_qkv.lora_A.weight``. Adapters on ``mlp.experts.*`` are expert-parallel
(``param.allreduce = False``), so megatron builds a separate expert optimizer for them.

With ``adapter_bias`` every ``lora_B`` also has a trainable bias (zero at start): a 1-D parameter,
which Muon hands to its scalar optimizer (Adam or Lion) while it keeps the matrices.

TP=2 works on CPU on megatron-core 0.16.1 and 0.19.2: the megatron layers are built with
``use_cpu_initialization=True``, which initialises the full weight and keeps this rank's slice,
so every weight is a function of (seed, parameter name) only, whatever the TP or DP size.
In a column-parallel linear the ``lora_A`` factor is replicated and ``lora_B`` is split with the
base output; in a row-parallel linear ``lora_A`` is split with the base input and ``lora_B`` is
replicated (the usual Megatron LoRA layout).

The expert linears (and their adapters) split over megatron's expert-tensor-parallel group, as
megatron's experts do: by default it is the TP group (``expert_tensor_parallel_size = tp``) and the
expert block runs exactly like the dense one. With ``etp != tp`` (``sim.layout``) the model is built
with ``initialize_model_parallel(..., expert_tensor_parallel_size=etp)``. Every expert linear takes
the expert-TP group as its ``tp_group``, so its split, its ``sharded_state_dict`` and its
all-reduces are on that group. The expert block gathers its input tokens over the group and scatters
its output back (``_expert_tokens``), as megatron's MoE token dispatcher does. With ``etp < tp``
each TP rank runs the whole experts on its own part of the sequence.

Context parallelism (``cp``) and virtual pipelines (``vpp``) are built as megatron builds them.
Inputs have shape [sequence, batch, hidden], and each CP rank trains on its own part
(``sim.layout.cp_positions``). Each pipeline stage has ``vpp`` model chunks, each numbering its
layers from 0 and taking its global layer offset from megatron's ``get_transformer_layer_offset``.

With ``lora_dropout > 0`` (Miles' ``--lora-dropout``) every adapter drops its input in training
mode, drawing from the RNG as megatron does. A row-parallel ``lora_A`` draws inside megatron's
tensor-parallel RNG tracker, each TP rank from its own stream. The replicated factor of a
column-parallel linear draws from torch's default generator, the same on every TP rank.
A resume is then bit-exact only with those RNG states restored (``core.rng_state``).
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from miles_lora_ckpt_harness.sim.layout import check_layout

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# "proj": an adapter on linear_proj only (the single-projection adapter a Miles native checkpoint maps onto)
ADAPTER_KINDS = ("dense", "expert-only", "mixed", "proj")
OPTIMIZERS = ("adam", "lion", "muon")  # how each is built: sim/optimizers.py
SCALAR_OPTIMIZERS = ("adam", "lion")  # Muon's `muon_scalar_optimizer` for non-matrix params


class DictConfig:
    """For the harness's config dataclasses: `to_dict` (JSON-able) and `from_dict` (unknown keys are an error)."""

    def to_dict(self) -> dict:
        """A JSON-able dict; ``from_dict(to_dict())`` gives an equal config."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        """Build a config from ``to_dict()`` output; unknown keys are an error."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
        return cls(**data)


@dataclass
class SimConfig(DictConfig):
    """Everything that defines a harness run; two equal configs give bit-identical runs."""

    world_size: int = 2
    tp: int = 1
    ep: int = 1  # expert-parallel size: each EP rank holds its own experts (and expert adapters)
    # expert-tensor-parallel size: the expert linears split over this group; None: tp (megatron's default)
    etp: int | None = None
    pp: int = 1  # pipeline stages: each holds num_layers/pp layers and trains on a local loss
    cp: int = 1  # context-parallel size: each CP rank trains on its part of every sequence
    vpp: int = 1  # virtual pipeline: model chunks per stage (needs pp >= 2), each with its own DDP
    dtype: str = "bf16"
    adapters: str = "dense"  # ADAPTER_KINDS: dense, expert-only, mixed, proj (linear_proj only)
    optimizer: str = "adam"
    muon_scalar: str = "adam"  # Muon only: the optimizer megatron gives non-matrix params (biases)
    # None: what megatron builds for the optimizer (sim/optimizers.py); True: DistributedOptimizer
    # children; False: Float16OptimizerWithFloat16Params (bf16) / FP32Optimizer (fp32) children
    distributed: bool | None = None
    layer_wise: bool = False  # a LayerWiseDistributedOptimizer (whole params sharded over DP ranks)
    slots: int = 1  # >1: per-slot children under one LayerWise chain, as Miles multi-LoRA builds it
    adapter_bias: bool = False  # a trainable 1-D bias on every lora_B (Muon's scalar optimizer gets it)
    # 0: one expert per EP rank (`mlp.experts.linear_fc1`, seeded by EP rank: the model depends on
    # the EP size). N > 0: N experts in all, numbered globally as megatron numbers them
    # (`mlp.experts.local_experts.{i}`, the MoE layer's `local_expert_indices`), N / ep per EP rank,
    # each seeded by its global index: the same model at every EP size (what resharding needs)
    num_experts: int = 0
    seed: int = 1234
    num_layers: int = 2
    hidden: int = 16
    ffn_hidden: int = 32
    lora_rank: int = 4
    lora_alpha: float = 4.0
    lora_dropout: float = 0.0  # Miles' --lora-dropout: each adapter drops its input (training mode)
    micro_batch: int = 4
    seq_length: int = 4  # tokens per sequence; CP splits it into 2*cp pieces
    lr: float = 1e-2
    min_lr: float = 1e-3
    lr_warmup_iters: int = 2
    train_iters: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0

    def __post_init__(self):
        check_layout(
            self.world_size, self.tp, self.pp, self.ep, self.cp, self.vpp, self.num_layers, self.seq_length, self.etp
        )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.adapters not in ADAPTER_KINDS:
            raise ValueError(f"adapters must be one of {ADAPTER_KINDS}, got {self.adapters!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.muon_scalar not in SCALAR_OPTIMIZERS:
            raise ValueError(f"muon_scalar must be one of {SCALAR_OPTIMIZERS}, got {self.muon_scalar!r}")
        if (self.layer_wise or self.slots > 1) and self.distributed:
            raise ValueError("layer_wise (and slots > 1) shard whole parameters: distributed must be False or None")
        if self.num_experts < 0 or (self.num_experts and self.num_experts % self.ep):
            raise ValueError(f"num_experts must be 0 or a multiple of ep={self.ep}, got {self.num_experts}")
        if self.slots < 1 or (self.slots > 1 and (self.pp > 1 or self.num_layers % self.slots)):
            raise ValueError(f"slots must be >= 1, divide num_layers and need pp=1, got slots={self.slots}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")

    @property
    def dp(self) -> int:
        """Data-parallel size (without context parallelism; the optimizer shards over dp * cp)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def expert_tp(self) -> int:
        """The expert-tensor-parallel size megatron is initialised with (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_tp_differs(self) -> bool:
        """Whether the expert linears split over their own expert-TP group (``etp != tp``)."""
        return self.expert_tp != self.tp

    @property
    def uses_layer_wise(self) -> bool:
        """Whether the optimizer is a LayerWiseDistributedOptimizer (``layer_wise`` or several slots)."""
        return self.layer_wise or self.slots > 1

    def slot_of(self, layer: int) -> int:
        """The slot whose adapters live in global layer ``layer`` (layers are dealt round-robin)."""
        return layer % self.slots

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model parameters' dtype."""
        return DTYPES[self.dtype]

    @property
    def dense_adapters(self) -> bool:
        """Whether the dense (attention-like) linears carry adapters."""
        return self.adapters in ("dense", "mixed", "proj")

    @property
    def expert_adapters(self) -> bool:
        """Whether the expert linears carry (expert-parallel) adapters."""
        return self.adapters in ("expert-only", "mixed")


def seeded_init(seed: int, name: str, std: float):
    """An ``init_method`` that fills a tensor from (seed, name) only: never from the rank."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator_seed = int.from_bytes(digest[:8], "little") & (2**63 - 1)

    def init(tensor: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(generator_seed)
        values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std
        with torch.no_grad():
            return tensor.copy_(values)

    return init


def transformer_config(config: SimConfig) -> TransformerConfig:
    """The megatron config that the layers, Float16Module and DDP read."""
    extra = {"expert_tensor_parallel_size": config.expert_tp} if config.expert_tp_differs else {}
    return TransformerConfig(
        **extra,
        num_layers=config.num_layers,
        hidden_size=config.hidden,
        ffn_hidden_size=config.ffn_hidden,
        num_attention_heads=2,
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        context_parallel_size=config.cp,
        pipeline_dtype=config.torch_dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=config.torch_dtype,
        bf16=config.dtype == "bf16",
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )


class LoraLinear(torch.nn.Module):
    """A frozen megatron base linear plus ``scale * lora_B(lora_A(x))``.

    ``parallel="column"`` maps hidden -> ffn_hidden (output split over TP); ``"row"`` maps back
    (input split over TP, output all-reduced).
    """

    def __init__(self, mcfg, config: SimConfig, name: str, parallel: str, *, adapter: bool, expert: bool):
        super().__init__()
        sizes = (config.hidden, config.ffn_hidden) if parallel == "column" else (config.ffn_hidden, config.hidden)
        self.parallel = parallel
        self.scale = config.lora_alpha / config.lora_rank
        self.dropout = getattr(config, "lora_dropout", 0.0)
        if expert and config.ep > 1 and not config.num_experts:  # distinct experts on each expert-parallel rank
            name = f"{name}@ep{parallel_state.get_expert_model_parallel_rank()}"
        # the expert-TP group when it is not the TP group; None: megatron's TP group
        self.tp_group = (
            parallel_state.get_expert_tensor_parallel_group() if expert and config.expert_tp_differs else None
        )
        self.base_layer = _megatron_linear(mcfg, parallel, *sizes, config.seed, f"{name}.base_layer", self.tp_group)
        self.base_layer.weight.requires_grad_(False)
        self.lora_A = self.lora_B = None
        self.adapter_enabled = True  # False: forward through the base only (another slot is training)
        if adapter:
            self._add_adapter(mcfg, config, name, *sizes)
        if adapter and expert:
            for param in [*self.lora_A.parameters(), *self.lora_B.parameters()]:
                param.allreduce = False  # megatron's mark for expert-parallel params

    def _add_adapter(self, mcfg, config: SimConfig, name: str, in_size: int, out_size: int):
        rank, seed, bias = config.lora_rank, config.seed, config.adapter_bias
        if self.parallel == "column":  # A replicated, B split like the base output
            self.lora_A = _replicated_linear(in_size, rank, seed, f"{name}.lora_A")
            self.lora_B = _megatron_linear(
                mcfg, "column", rank, out_size, seed, f"{name}.lora_B", self.tp_group, bias=bias
            )
        else:  # A split like the base input, B replicated
            self.lora_A = _megatron_linear(mcfg, "row", in_size, rank, seed, f"{name}.lora_A", self.tp_group)
            self.lora_B = _replicated_linear(rank, out_size, seed, f"{name}.lora_B", bias=bias)

    def forward(self, x):
        out, _ = self.base_layer(x)
        if self.lora_A is None or not self.adapter_enabled:
            return out
        x = self._dropped(x)
        if self.parallel == "column":
            delta, _ = self.lora_B(self.lora_A(x))
        else:
            low_rank, _ = self.lora_A(x)
            delta = self.lora_B(low_rank)
        return out + self.scale * delta

    def _dropped(self, x):
        """The adapter's input after LoRA dropout (training mode, `lora_dropout > 0`; else `x`)."""
        if not self.dropout or not self.training:
            return x
        if self.parallel == "row":  # split over TP: megatron draws inside its tracker's fork
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout(x, self.dropout, training=True)
        return torch.nn.functional.dropout(x, self.dropout, training=True)


def _init_std(name: str, in_size: int) -> float:
    # Base and lora_A keep activations O(1); lora_B is small but NOT zero, so adapters matter at step 0.
    return (0.1 if ".lora_B" in name else 0.5 if ".base_layer" in name else 1.0) / math.sqrt(in_size)


def _megatron_linear(mcfg, parallel, in_size, out_size, seed, name, tp_group=None, bias=False):
    init = seeded_init(seed, f"{name}.weight", std=_init_std(name, in_size))
    # is_expert stays False: megatron's expert layers leave TP communication to a MoE token
    # dispatcher (explicit_expert_comm), which this model does not have. The expert adapters are
    # expert-parallel for DDP and the optimizer through ``param.allreduce = False`` alone.
    # A bias starts at zero (megatron's default); it is only ever an adapter's (lora_B) bias.
    # `tp_group`: the expert-TP group of an expert linear when etp != tp (split, all-reduces and
    # sharded_state_dict on it); None keeps megatron's TP group.
    common = dict(config=mcfg, init_method=init, bias=bias)
    if tp_group is not None:
        common["tp_group"] = tp_group
    if parallel == "column":
        return tensor_parallel.ColumnParallelLinear(in_size, out_size, gather_output=False, **common)
    return tensor_parallel.RowParallelLinear(in_size, out_size, input_is_parallel=True, skip_bias_add=False, **common)


def _replicated_linear(in_size, out_size, seed, name, bias=False):
    layer = torch.nn.Linear(in_size, out_size, bias=bias)
    seeded_init(seed, f"{name}.weight", std=_init_std(name, in_size))(layer.weight)
    if bias:
        with torch.no_grad():
            layer.bias.zero_()
    return layer


def _up_down(x, up, down):
    return x + down(torch.nn.functional.gelu(up(x)))


def _expert_tokens(config: SimConfig, x, block):
    """``x + block(x)`` for an expert block.

    With ``etp > tp`` the expert-TP group's ranks are data-parallel (or context-parallel) replicas
    holding their own tokens. The tokens of the whole group are gathered (sequence axis, rank
    order), the block runs on all of them split over the group, and each rank keeps its own tokens'
    output. Backward: the scatter all-gathers the output grads, so each expert shard learns from
    every token of the group. The gather keeps this rank's part of the input grad, which the
    column-parallel linears already all-reduced over the group.

    With ``etp < tp`` it is the mirror image: the TP ranks hold the same tokens and the experts
    whole. Each TP rank runs the block on its own part of the tokens along the sequence, as
    megatron's sequence parallelism hands it to the MoE layer. The outputs are gathered back over
    the TP group. Backward: the gather keeps this rank's part of the output grad, and the scatter
    all-gathers the input grads. Each rank's expert grads cover its own tokens, summed over the
    expert data-parallel group (the TP ranks) by megatron's DDP."""
    if not config.expert_tp_differs:
        return x + block(x)
    if config.expert_tp < config.tp:
        group = parallel_state.get_tensor_model_parallel_group()
        return x + _GatherTokens.apply(block(_ScatterTokens.apply(x, group)), group)
    group = parallel_state.get_expert_tensor_parallel_group()
    tokens = _GatherTokens.apply(x, group)
    return x + _ScatterTokens.apply(block(tokens), group)


def _all_gather_tokens(tensor: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _own_tokens(tensor: torch.Tensor, group) -> torch.Tensor:
    return tensor.chunk(torch.distributed.get_world_size(group), dim=0)[torch.distributed.get_rank(group)].clone()


class _GatherTokens(torch.autograd.Function):
    """Forward: every rank's tokens of ``group``, concatenated in rank order on the sequence axis;
    backward: this rank's part of the grad (megatron's ``gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``; ours because megatron's allocates on ``cuda`` inside
    backward, where the harness's CPU device mode does not reach)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _all_gather_tokens(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_tokens(grad, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    """Forward: this rank's tokens; backward: the grads of every rank's tokens, concatenated (megatron's
    ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _own_tokens(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_tokens(grad, ctx.group), None


class SimLayer(torch.nn.Module):
    """A dense block (``linear_qkv`` -> ``linear_proj``) then an expert block (``mlp.experts.*``)."""

    def __init__(self, mcfg, config: SimConfig, index: int):
        super().__init__()
        self.global_index = index  # the layer's index in the whole model (seeds its weights)
        self.layer_number = index + 1  # as megatron's TransformerLayer: global, from 1 (param_blocks)
        prefix = f"layers.{index}"
        dense = dict(adapter=config.dense_adapters, expert=False)
        expert = dict(adapter=config.expert_adapters, expert=True)
        qkv = dict(dense, adapter=config.dense_adapters and config.adapters != "proj")
        self.linear_qkv = LoraLinear(mcfg, config, f"{prefix}.linear_qkv", "column", **qkv)
        self.linear_proj = LoraLinear(mcfg, config, f"{prefix}.linear_proj", "row", **dense)
        if config.num_experts:
            self.mlp = SimMoE(mcfg, config, prefix, expert)
            return
        experts = {
            "linear_fc1": LoraLinear(mcfg, config, f"{prefix}.mlp.experts.linear_fc1", "column", **expert),
            "linear_fc2": LoraLinear(mcfg, config, f"{prefix}.mlp.experts.linear_fc2", "row", **expert),
        }
        self.mlp = torch.nn.ModuleDict({"experts": torch.nn.ModuleDict(experts)})
        self.sim_config = config

    def forward(self, x):
        x = _up_down(x, self.linear_qkv, self.linear_proj)
        if isinstance(self.mlp, SimMoE):
            return self.mlp(x)
        experts = self.mlp["experts"]
        if not self.sim_config.expert_tp_differs:  # the default: unchanged
            return _up_down(x, experts["linear_fc1"], experts["linear_fc2"])
        fc1, fc2 = experts["linear_fc1"], experts["linear_fc2"]
        return _expert_tokens(self.sim_config, x, lambda t: fc2(torch.nn.functional.gelu(fc1(t))))


class SimMoE(torch.nn.Module):
    """``num_experts / ep`` experts of one layer on this EP rank, as megatron's MoE layer holds them:
    ``experts.local_experts.{i}.linear_fc1/2``, with the global index of local expert ``i`` in
    ``local_expert_indices`` (``ep_rank * num_local + i``). Every local expert sees every token
    (no router): ``x + sum_e fc2_e(gelu(fc1_e(x)))``."""

    def __init__(self, mcfg, config: SimConfig, prefix: str, expert: dict):
        super().__init__()
        local = config.num_experts // config.ep
        first = parallel_state.get_expert_model_parallel_rank() * local
        self.local_expert_indices = [first + i for i in range(local)]
        experts = []
        for index in self.local_expert_indices:
            name = f"{prefix}.mlp.experts.local_experts.{index}"
            experts.append(
                torch.nn.ModuleDict(
                    {
                        "linear_fc1": LoraLinear(mcfg, config, f"{name}.linear_fc1", "column", **expert),
                        "linear_fc2": LoraLinear(mcfg, config, f"{name}.linear_fc2", "row", **expert),
                    }
                )
            )
        self.experts = torch.nn.Module()
        self.experts.local_experts = torch.nn.ModuleList(experts)
        self.sim_config = config
        # False (training): this EP rank's experts on its own tokens. True (`every_expert_on_every_token`,
        # no grad): every expert of the layer on every token, dispatched over the EP group
        self.dispatch = False

    def forward(self, x):
        block = self._dispatched if self.dispatch and self.sim_config.ep > 1 else None
        if self.sim_config.expert_tp_differs:
            return _expert_tokens(self.sim_config, x, block or (lambda t: self._experts(t, torch.zeros_like(t))))
        return x + block(x) if block else self._experts(x, x)

    def _dispatched(self, x):
        """The output of every expert of the layer, on every EP rank, for this rank's tokens ``x``.

        The tokens of the EP group are gathered (sequence axis, rank order) and each rank's local
        experts run on all of them. Their sums are added up over the group and this rank's part
        kept, as megatron's token dispatcher does with every token routed to every expert. Forward
        only: its collectives are not autograd functions."""
        if torch.is_grad_enabled():
            raise RuntimeError("the dispatched expert forward is for inference only (torch.no_grad)")
        group = parallel_state.get_expert_model_parallel_group()
        tokens = _all_gather_tokens(x, group)
        out = self._experts(tokens, torch.zeros_like(tokens))
        torch.distributed.all_reduce(out, group=group)
        return _own_tokens(out, group)

    def _experts(self, x, out):
        for expert in self.experts.local_experts:
            out = out + expert["linear_fc2"](torch.nn.functional.gelu(expert["linear_fc1"](x)))
        return out


@contextmanager
def every_expert_on_every_token(modules):
    """Within the block (forward only, under ``torch.no_grad``), run the experts of ``modules`` as
    the whole model's: every token through every expert of its layer, whichever EP rank holds it.

    So an EP > 1 run computes the same function as an EP 1 run of the same weights, up to reduction
    order. Training keeps each EP rank's local experts on its own tokens."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, SimMoE)]
    for layer in layers:
        layer.dispatch = True
    try:
        yield
    finally:
        for layer in layers:
            layer.dispatch = False


class SimLoraModel(MegatronModule):
    """One model chunk: ``num_layers / (pp * vpp)`` SimLayers on a [sequence, batch, hidden] input.

    ``vp_stage`` is the chunk's virtual-pipeline index (None without VPP), as megatron's model
    providers take it; ``pre_process`` / ``post_process`` follow megatron's ``get_model``.
    """

    def __init__(self, mcfg: TransformerConfig, config: SimConfig, vp_stage: int | None = None):
        super().__init__(config=mcfg)
        # This chunk's layers: numbered locally (as megatron names them), seeded by global index.
        per_chunk = config.num_layers // (config.pp * config.vpp)
        first = get_transformer_layer_offset(mcfg, vp_stage=vp_stage)
        self.layers = torch.nn.ModuleList(SimLayer(mcfg, config, first + i) for i in range(per_chunk))
        self.vp_stage = vp_stage
        chunk = 0 if vp_stage is None else vp_stage
        # What megatron's finalize_model_grads asks a pipelined model: no tied embeddings here.
        self.pre_process = parallel_state.is_pipeline_first_stage() and chunk == 0
        self.post_process = parallel_state.is_pipeline_last_stage() and chunk == config.vpp - 1
        self.share_embeddings_and_output_weights = False

    def set_input_tensor(self, input_tensor):
        """Pipeline hook megatron wrappers forward to; stages here train on local losses instead."""

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
