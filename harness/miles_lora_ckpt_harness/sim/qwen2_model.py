"""A tiny Qwen2-shaped megatron model with Megatron-Bridge-style LoRA, for the PEFT export path.

Megatron-side names and shapes are those of a Qwen2 decoder in megatron-core, so a Bridge export maps
them onto a real HF `Qwen2ForCausalLM` (see `hf_base.py`)::

    decoder.layers.{i}.self_attention.linear_qkv   fused Q/K/V with GQA: rows grouped per query
                                                   group [q heads of the group, k, v] (split over TP by group)
    decoder.layers.{i}.self_attention.linear_proj  heads*head_dim -> hidden (row parallel)
    decoder.layers.{i}.mlp.linear_fc1              fused [gate; up] per TP shard (column parallel)
    decoder.layers.{i}.mlp.linear_fc2              ffn -> hidden (row parallel)

Each is a frozen base `to_wrap` plus an adapter `adapter.linear_in` [r, in] / `adapter.linear_out`
[out, r] laid out as Bridge's LoRA does it: for a column-parallel base, `linear_in` is column parallel
with a gathered output (sharded on the rank dimension) and `linear_out` column parallel; for a
row-parallel base, `linear_in` is row parallel and `linear_out` column parallel with a gathered output.
So at TP=2 every adapter tensor is sharded, and an export must gather each one.

The forward keeps the block's data flow (QKV -> per-group mixing -> proj, SwiGLU MLP) on a [batch,
hidden] input without attention over a sequence: the harness needs the real DistributedOptimizer to
train these adapters, not a language model. Base biases and norms are omitted (they are not adapter
weights). Attention-style mixing per query group keeps every TP rank's computation local, as in megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from miles_lora_ckpt_harness.sim.model import DTYPES, OPTIMIZERS, DictConfig, seeded_init

ADAPTERS = ("all", "attention", "none")  # which linears carry LoRA ("none": an empty adapter)
MODEL = "qwen2"


@dataclass
class Qwen2SimConfig(DictConfig):
    """A harness run of the Qwen2-shaped model; two equal configs give bit-identical runs.

    Fields shared with `SimConfig` mean the same; `sim.train.build_run` builds either.
    """

    model: str = MODEL
    world_size: int = 2
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1  # read by the shared run builder; the Qwen2-shaped model runs without CP and VPP
    vpp: int = 1
    seq_length: int = 1
    dtype: str = "bf16"
    adapters: str = "all"
    optimizer: str = "adam"
    # the optimizer family, as `SimConfig` (sim/optimizers.py builds either config's optimizer)
    muon_scalar: str = "adam"
    distributed: bool | None = None
    layer_wise: bool = False
    slots: int = 1  # the Qwen2-shaped model trains one adapter
    seed: int = 1234
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    query_groups: int = 2  # GQA: key/value heads
    head_dim: int = 16
    ffn_hidden: int = 128
    vocab: int = 128  # of the HF base only (the harness trains on hidden-state inputs)
    lora_rank: int = 4
    lora_alpha: float = 8.0
    micro_batch: int = 4
    lr: float = 1e-2
    min_lr: float = 1e-3
    lr_warmup_iters: int = 2
    train_iters: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    # True: fc1's [gate; up] rows (base and adapter output) are initialised from the logical TP-1
    # weight, so every TP size builds the same model (what a resharding comparison needs); False:
    # megatron's plain split of a seeded master weight, so each TP rank's gate and up halves depend
    # on the TP size (as the export tests were written)
    same_model_at_every_tp: bool = False
    # False: a plain (non-gated) fc1 of ffn_hidden outputs and gelu, as a non-swiglu megatron MLP
    # (`gated_linear_unit=False`); not a Qwen2 (the HF export maps a gated MLP only)
    swiglu: bool = True

    def __post_init__(self):
        if self.model != MODEL:
            raise ValueError(f"Qwen2SimConfig.model must be {MODEL!r}")
        if self.tp < 1 or self.world_size % self.tp or self.query_groups % self.tp or self.lora_rank % self.tp:
            raise ValueError(f"tp={self.tp} must divide world_size, query_groups and lora_rank")
        if self.ffn_hidden % self.tp or self.heads % self.query_groups:
            raise ValueError("tp must divide ffn_hidden and query_groups must divide heads")
        if self.pp < 1 or self.num_layers % self.pp or self.world_size % (self.pp * self.tp):
            raise ValueError(f"pp must divide num_layers and world_size/tp, got pp={self.pp}")
        if self.ep != 1:
            raise ValueError("the Qwen2-shaped model has no experts (ep must be 1)")
        if (self.cp, self.vpp, self.seq_length) != (1, 1, 1):
            raise ValueError("the Qwen2-shaped model runs without context parallelism or virtual pipelines")
        if self.dtype not in DTYPES or self.optimizer not in OPTIMIZERS or self.adapters not in ADAPTERS:
            raise ValueError(f"bad dtype/optimizer/adapters: {self.dtype!r}, {self.optimizer!r}, {self.adapters!r}")
        if self.slots != 1 or (self.layer_wise and self.distributed):
            raise ValueError("the Qwen2-shaped model trains one adapter (slots=1); layer_wise needs distributed off")

    @property
    def uses_layer_wise(self) -> bool:
        """Whether the optimizer is a LayerWiseDistributedOptimizer."""
        return self.layer_wise

    def slot_of(self, layer: int) -> int:
        """Every layer's adapters belong to the one slot."""
        return 0

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def qkv_size(self) -> int:
        return (self.heads + 2 * self.query_groups) * self.head_dim

    def hf_config_kwargs(self) -> dict:
        """`transformers.Qwen2Config(**kwargs)` of the HF base with the same shapes."""
        return {
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn_hidden,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.query_groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
        }

    def transformer_config(self) -> TransformerConfig:
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden,
            ffn_hidden_size=self.ffn_hidden,
            num_attention_heads=self.heads,
            num_query_groups=self.query_groups,
            kv_channels=self.head_dim,
            gated_linear_unit=self.swiglu,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            pipeline_dtype=self.torch_dtype,
            use_cpu_initialization=True,
            perform_initialization=True,
            params_dtype=self.torch_dtype,
            bf16=self.dtype == "bf16",
            gradient_accumulation_fusion=False,
            sequence_parallel=False,
        )


def _linear(mcfg, kind: str, in_size: int, out_size: int, name: str, std: float, **extra):
    init = seeded_init(extra.pop("seed"), f"{name}.weight", std=std)
    gated_tp = extra.pop("gated_tp", 0)
    if gated_tp:
        init = _gated_rows(init, gated_tp)
    common = dict(config=mcfg, init_method=init, bias=False)
    if kind == "column":
        return tensor_parallel.ColumnParallelLinear(in_size, out_size, **common, **extra)
    return tensor_parallel.RowParallelLinear(in_size, out_size, input_is_parallel=True, skip_bias_add=False, **common)


def _gated_rows(init, tp: int):
    """An `init_method` for a gated fc1's output rows, the same logical weight at every TP size.

    The logical `[gate; up]` weight (as at TP 1) is reordered into `[gate_0; up_0; gate_1; up_1;
    ...]`. Megatron's plain split of the master weight then gives TP rank `r` its `[gate_r; up_r]`
    (`Qwen2SimConfig.same_model_at_every_tp`)."""

    def reordered(tensor: torch.Tensor) -> torch.Tensor:
        init(tensor)
        with torch.no_grad():
            gate, up = tensor.clone().chunk(2)
            rows = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
            return tensor.copy_(torch.cat(rows))

    return reordered


class Adapter(torch.nn.Module):
    """Bridge-style LoRA factors `linear_in` [r, in] and `linear_out` [out, r] of one base linear."""

    def __init__(
        self, mcfg, config: Qwen2SimConfig, name: str, parallel: str, in_size: int, out_size: int, gated_tp: int = 0
    ):
        super().__init__()
        r, seed = config.lora_rank, config.seed
        if parallel == "column":
            self.linear_in = _linear(
                mcfg, "column", in_size, r, f"{name}.linear_in", in_size**-0.5, seed=seed, gather_output=True
            )
        else:
            self.linear_in = _linear(mcfg, "row", in_size, r, f"{name}.linear_in", in_size**-0.5, seed=seed)
        # B is small but not zero, so the adapter matters from step 0
        gather = parallel == "row"
        self.linear_out = _linear(
            mcfg,
            "column",
            r,
            out_size,
            f"{name}.linear_out",
            0.1 * r**-0.5,
            seed=seed,
            gather_output=gather,
            gated_tp=gated_tp,
        )


class LoraWrapped(torch.nn.Module):
    """`to_wrap` (frozen megatron base linear) plus `scale * linear_out(linear_in(x))`."""

    def __init__(
        self,
        mcfg,
        config: Qwen2SimConfig,
        name: str,
        parallel: str,
        in_size: int,
        out_size: int,
        lora: bool,
        gated_tp: int = 0,
    ):
        super().__init__()
        self.parallel = parallel
        self.scale = config.lora_alpha / config.lora_rank
        extra = {"gather_output": False} if parallel == "column" else {}
        if gated_tp:
            extra["gated_tp"] = gated_tp
        self.to_wrap = _linear(
            mcfg, parallel, in_size, out_size, f"{name}.to_wrap", 0.5 * in_size**-0.5, seed=config.seed, **extra
        )
        self.to_wrap.weight.requires_grad_(False)
        self.adapter = None
        if lora:
            self.adapter = Adapter(mcfg, config, f"{name}.adapter", parallel, in_size, out_size, gated_tp=gated_tp)

    def forward(self, x):
        out, _ = self.to_wrap(x)
        if self.adapter is None:
            return out
        low_rank, _ = self.adapter.linear_in(x)
        delta, _ = self.adapter.linear_out(low_rank)
        return out + self.scale * delta


class Attention(torch.nn.Module):
    def __init__(self, mcfg, config: Qwen2SimConfig, prefix: str):
        super().__init__()
        self.config = config
        lora = config.adapters in ("all", "attention")
        heads_out = config.heads * config.head_dim
        self.linear_qkv = LoraWrapped(
            mcfg, config, f"{prefix}.linear_qkv", "column", config.hidden, config.qkv_size, lora
        )
        self.linear_proj = LoraWrapped(mcfg, config, f"{prefix}.linear_proj", "row", heads_out, config.hidden, lora)

    def forward(self, x):
        c = self.config
        per_group = c.heads // c.query_groups
        qkv = self.linear_qkv(x).view(x.shape[0], c.query_groups // c.tp, per_group + 2, c.head_dim)
        q, k, v = qkv[:, :, :per_group], qkv[:, :, per_group : per_group + 1], qkv[:, :, per_group + 1 :]
        mixed = q * torch.sigmoid(k) + v  # each query head of a group mixes with that group's k and v
        return self.linear_proj(mixed.reshape(x.shape[0], -1))


class Mlp(torch.nn.Module):
    def __init__(self, mcfg, config: Qwen2SimConfig, prefix: str):
        super().__init__()
        lora = config.adapters == "all"
        self.config = mcfg  # as megatron's MLP: `gated_linear_unit` marks fc1's fused [gate; up] (param_blocks)
        self.swiglu = config.swiglu
        gated_tp = config.tp if config.same_model_at_every_tp and config.swiglu else 0
        fc1_out = (2 if config.swiglu else 1) * config.ffn_hidden
        self.linear_fc1 = LoraWrapped(
            mcfg, config, f"{prefix}.linear_fc1", "column", config.hidden, fc1_out, lora, gated_tp
        )
        self.linear_fc2 = LoraWrapped(
            mcfg, config, f"{prefix}.linear_fc2", "row", config.ffn_hidden, config.hidden, lora
        )

    def forward(self, x):
        if not self.swiglu:
            return self.linear_fc2(torch.nn.functional.gelu(self.linear_fc1(x)))
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)  # this TP rank's [gate; up] shard
        return self.linear_fc2(torch.nn.functional.silu(gate) * up)


class Layer(torch.nn.Module):
    def __init__(self, mcfg, config: Qwen2SimConfig, index: int):
        super().__init__()
        self.layer_number = index + 1  # as megatron's TransformerLayer: global, from 1 (param_blocks)
        self.self_attention = Attention(mcfg, config, f"decoder.layers.{index}.self_attention")
        self.mlp = Mlp(mcfg, config, f"decoder.layers.{index}.mlp")

    def forward(self, x):
        x = x + self.self_attention(x)
        return x + self.mlp(x)


class Decoder(torch.nn.Module):
    def __init__(self, mcfg, config: Qwen2SimConfig):
        super().__init__()
        # This stage's layers, numbered locally (as megatron names them) and seeded by global index.
        per_stage = config.num_layers // config.pp
        first = parallel_state.get_pipeline_model_parallel_rank() * per_stage
        self.layers = torch.nn.ModuleList(Layer(mcfg, config, first + i) for i in range(per_stage))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SimQwen2Model(MegatronModule):
    """`decoder.layers.*` of a Qwen2 decoder with Bridge-style LoRA; one pipeline stage's share."""

    def __init__(self, mcfg: TransformerConfig, config: Qwen2SimConfig):
        super().__init__(config=mcfg)
        self.decoder = Decoder(mcfg, config)
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.share_embeddings_and_output_weights = False

    def set_input_tensor(self, input_tensor):
        """Pipeline hook; stages train on local losses (see sim.train)."""

    def forward(self, x):
        # the shared train step feeds [sequence, batch, hidden]; the layers here mix tokens per row
        return self.decoder(x.reshape(-1, x.shape[-1])).reshape(x.shape)
