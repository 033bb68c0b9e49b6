"""The fp64 reference for PEFT exports, computed from the raw Megatron-side adapter shards alone.

(The factors are bf16 and the ranks small, so every `B @ A` here is exact in fp64 and can be
compared with PEFT's for equality; the logits pass HF's RMSNorm, which computes in fp32.)

Independent of the Bridge double and of the offline converter: no reshape/chunk of fused tensors.
Each TP rank's contribution is computed the way the harness model's forward applies it, and every
row or column of it is placed into the HF weight by index arithmetic:

- column-parallel base (linear_qkv, linear_fc1): rank t adds `B_t @ A` to its own output rows, where
  `A` is the gathered `linear_in` (its shards are rank rows). Row i of rank t is Megatron row
  `t * rows + i`; in linear_qkv that row belongs to query group `g = row // ((hpg + 2) * hd)` and is a
  q, k or v row by its place in the group; in linear_fc1 each rank's rows are [gate shard; up shard].
- row-parallel base (linear_proj, linear_fc2): the output is the sum over ranks of
  `B @ (A_t @ x_t)`, with `B` the gathered `linear_out` and `x_t` rank t's input columns.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from miles_lora_ckpt.core.checked_reads import load_tensors

_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.(self_attention\.linear_\w+|mlp\.linear_\w+)\.adapter\.(linear_in|linear_out)\.weight$"
)


def megatron_shards(directory: Path, per_stage: int) -> dict[tuple[int, str], dict[str, dict[int, torch.Tensor]]]:
    """`{(global layer, kind): {"linear_in"/"linear_out": {tp rank: fp64 tensor}}}` (DP replicas once)."""
    found: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(Path(directory).glob("rank*.safetensors")):
        tensors, meta = load_tensors(path)
        tp, pp = int(meta["tp"]), int(meta["pp"])
        for name, tensor in tensors.items():
            match = _NAME.match(name)
            assert match, name
            layer = int(match.group(1)) + pp * per_stage
            found[(layer, match.group(2))][match.group(3)].setdefault(tp, tensor.double())
    return found


def hf_deltas(directory: Path, config) -> dict[str, torch.Tensor]:
    """`{HF module path: scale * (B @ A) in fp64}` for every adapted module."""
    scale = config.lora_alpha / config.lora_rank
    per_group, hd = config.heads // config.query_groups, config.head_dim
    deltas: dict[str, torch.Tensor] = {}
    for (layer, kind), factors in megatron_shards(directory, config.num_layers // config.pp).items():
        tps = sorted(factors["linear_out"])
        prefix = f"model.layers.{layer}"
        if kind in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            a = torch.cat([factors["linear_in"][t] for t in tps], dim=0)  # linear_in shards are rank rows
            if kind == "self_attention.linear_qkv":
                out = {p: torch.zeros(n * hd, a.shape[1], dtype=torch.float64) for p, n in _qkv_heads(config).items()}
            else:
                out = {
                    p: torch.zeros(config.ffn_hidden, a.shape[1], dtype=torch.float64) for p in ("gate_proj", "up_proj")
                }
            for t in tps:
                local = factors["linear_out"][t] @ a  # this rank's output rows
                for i in range(local.shape[0]):
                    proj, row = _place(kind, t, i, local.shape[0], config, per_group, hd)
                    out[proj][row] = local[i]
            block = "self_attn" if kind.startswith("self_attention") else "mlp"
            deltas.update({f"{prefix}.{block}.{p}": scale * w for p, w in out.items()})
        else:
            b = torch.cat([factors["linear_out"][t] for t in tps], dim=0)  # gathered output rows
            in_tp = factors["linear_in"][tps[0]].shape[1]
            full = torch.zeros(b.shape[0], in_tp * len(tps), dtype=torch.float64)
            for t in tps:
                full[:, t * in_tp : (t + 1) * in_tp] = b @ factors["linear_in"][t]
            name = "self_attn.o_proj" if kind == "self_attention.linear_proj" else "mlp.down_proj"
            deltas[f"{prefix}.{name}"] = scale * full
    return deltas


def _qkv_heads(config) -> dict[str, int]:
    return {"q_proj": config.heads, "k_proj": config.query_groups, "v_proj": config.query_groups}


def _place(kind: str, t: int, i: int, rows: int, config, per_group: int, hd: int) -> tuple[str, int]:
    if kind == "mlp.linear_fc1":
        half = rows // 2
        return ("gate_proj", t * half + i) if i < half else ("up_proj", t * half + i - half)
    row = t * rows + i
    group, within = divmod(row, (per_group + 2) * hd)
    if within < per_group * hd:
        return "q_proj", group * per_group * hd + within
    if within < (per_group + 1) * hd:
        return "k_proj", group * hd + within - per_group * hd
    return "v_proj", group * hd + within - (per_group + 1) * hd


def reference_logits(base_dir: Path, deltas: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """fp64 logits of the base with every adapted weight replaced by W + delta."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True).double().eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, delta in deltas.items():
            weight = modules[name].weight
            assert weight.shape == delta.shape, (name, weight.shape, delta.shape)
            weight += delta
        return model(input_ids).logits


def base_logits(base_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    return reference_logits(base_dir, {}, input_ids)


def peft_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a loaded PeftModel in fp64 (its LoRA factors hold the exported bf16 values exactly)."""
    model = model.double().eval()
    with torch.no_grad():
        return model(input_ids).logits


def peft_deltas(model) -> dict[str, torch.Tensor]:
    """`{HF module path: scaling * (B @ A)}` of every LoRA layer of a loaded PeftModel, in fp64."""
    deltas = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].weight.double()
            b = module.lora_B["default"].weight.double()
            deltas[name] = module.scaling["default"] * (b @ a)
    return deltas
