"""TEST DOUBLE of `AutoBridge.export_adapter_weights` (Megatron -> HF names), from Bridge's docs.

Collective and lazy, like Bridge. On the first `next()` the pipeline stages exchange which adapter
modules they hold, as JSON in uint8 tensors over the PP group (no pickle). Then, for every module in
one global order, the owning stage all-gathers each tensor-parallel shard over the TP group along
`param.partition_dim`, and broadcasts the full tensor to the other stages.
Every rank yields the same tensors in the same order. Names map as Bridge maps a Qwen2/Llama decoder::

    decoder.layers.{i}.self_attention.linear_qkv  -> model.layers.{i}.self_attn.{q,k,v}_proj  (split per query group)
    decoder.layers.{i}.self_attention.linear_proj -> model.layers.{i}.self_attn.o_proj
    decoder.layers.{i}.mlp.linear_fc1             -> model.layers.{i}.mlp.{gate,up}_proj  (each TP shard is [gate; up])
    decoder.layers.{i}.mlp.linear_fc2             -> model.layers.{i}.mlp.down_proj

Adapters are the modules' `adapter.linear_in` / `adapter.linear_out` (Bridge's LoRA naming); they
become `lora_A` / `lora_B`. A module without a mapping raises on every rank (all see the same list).
Virtual pipeline chunks are not supported by the double.
"""

from __future__ import annotations

import json
import re
from collections import namedtuple
from pathlib import Path

import torch
import torch.distributed as dist

HFWeightTuple = namedtuple("HFWeightTuple", ["param_name", "weight"])
ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
_KINDS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_MODULE_RE = re.compile(r"^decoder\.layers\.(\d+)\.(" + "|".join(re.escape(k) for k in _KINDS) + r")$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


class AutoBridgeDouble:
    """NVIDIA Megatron-Bridge's `AutoBridge` (Bridge `main`, after 0.6.2): two-item named tuples."""

    IS_TEST_DOUBLE = True

    def __init__(self, hf_config: dict):
        self.hf_config = hf_config

    @classmethod
    def from_hf_pretrained(cls, path, **kwargs):
        """Reads `path/config.json` (no weights, no hub); only the architectures the double maps."""
        config = json.loads((Path(path) / "config.json").read_text())
        archs = config.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"the Bridge double maps {ARCHITECTURES}, not {archs}")
        return cls(config)

    def export_adapter_weights(
        self, model, cpu=True, show_progress=True, exclude_adapter_base_prefixes=None, expand_shared_outer=False
    ):
        for hf_name, tensor, _megatron_name in _export(self, model, cpu, exclude_adapter_base_prefixes):
            yield HFWeightTuple(hf_name, tensor)


class ForkAutoBridgeDouble(AutoBridgeDouble):
    """Stands in for the fork Miles installs (radixark @7f0fb345): three items, narrower signature."""

    def export_adapter_weights(self, model, cpu=True, show_progress=True):
        yield from _export(self, model, cpu, None)


VARIANTS = {"nvidia": AutoBridgeDouble, "fork": ForkAutoBridgeDouble}


def _export(bridge: AutoBridgeDouble, model, cpu: bool, exclude):
    from megatron.core import parallel_state as mpu

    chunks = model if isinstance(model, list | tuple) else [model]
    if len(chunks) != 1:
        raise NotImplementedError("the Bridge double does not support virtual pipeline chunks")
    mcfg = chunks[0].config
    local = _local_modules(chunks[0], mcfg, mpu)
    tasks = _all_stages(local, mpu)  # [(module, owner pp rank, {"in": meta, "out": meta})]
    for module, owner, metas in tasks:
        if exclude and any(module.startswith(prefix) for prefix in exclude):
            continue
        factors = {}
        for which in ("in", "out"):
            param = local[module][which] if module in local else None
            factors[which] = _full_tensor(param, owner, metas[which], mpu)
        for hf_name, tensor, megatron_name in _to_hf(module, factors["in"], factors["out"], mcfg, mpu):
            yield hf_name, (tensor.cpu() if cpu else tensor), megatron_name


def _local_modules(chunk, mcfg, mpu) -> dict[str, dict[str, torch.nn.Parameter]]:
    """This stage's adapter modules under global names: `{module: {"in": param, "out": param}}`."""
    offset = mpu.get_pipeline_model_parallel_rank() * (mcfg.num_layers // mpu.get_pipeline_model_parallel_world_size())
    modules: dict[str, dict] = {}
    for name, param in chunk.named_parameters():
        while name.startswith("module."):
            name = name[len("module.") :]
        for which, suffix in (("in", ".adapter.linear_in.weight"), ("out", ".adapter.linear_out.weight")):
            if name.endswith(suffix):
                base = _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name[: -len(suffix)])
                modules.setdefault(base, {})[which] = param
    return modules


def _meta(param: torch.nn.Parameter, tp: int) -> dict:
    shape = list(param.shape)
    dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
    if dim >= 0:
        shape[dim] *= tp
    return {"shape": shape, "dtype": str(param.dtype).removeprefix("torch."), "dim": dim}


def _all_stages(local: dict, mpu) -> list[tuple[str, int, dict]]:
    """Every stage's modules, the same list on every rank, in layer order then block order."""
    tp = mpu.get_tensor_model_parallel_world_size()
    mine = {m: {w: _meta(p, tp) for w, p in pair.items()} for m, pair in local.items()}
    group = mpu.get_pipeline_model_parallel_group()
    listed = _all_gather_json(mine, group) if dist.get_world_size(group) > 1 else [mine]
    tasks = {}
    for owner, stage in enumerate(listed):
        for module, metas in stage.items():
            tasks.setdefault(module, (owner, metas))
    return [(m, owner, metas) for m, (owner, metas) in sorted(tasks.items(), key=lambda item: _order(item[0]))]


def _order(module: str) -> tuple:
    match = _MODULE_RE.match(module)
    if match is None:
        return (10**9, module)
    return (int(match.group(1)), _KINDS.index(match.group(2)))


def _full_tensor(param, owner: int, meta: dict, mpu) -> torch.Tensor:
    """The owning stage gathers the TP shards; then it broadcasts the full tensor over the PP group."""
    if param is not None:
        local = param.detach()
        if meta["dim"] >= 0:
            group = mpu.get_tensor_model_parallel_group()
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, local.contiguous(), group=group)
            full = torch.cat(shards, dim=meta["dim"])
        else:
            full = local.clone()
    else:
        full = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
    group = mpu.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) > 1:
        source = dist.get_process_group_ranks(group)[owner]
        dist.broadcast(full, src=source, group=group)
    return full


def _to_hf(module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, mcfg, mpu):
    match = _MODULE_RE.match(module)
    if match is None:
        raise ValueError(f"the Bridge double has no HF mapping for Megatron module {module!r}")
    layer, kind = f"model.layers.{match.group(1)}", match.group(2)
    names = {"in": f"{module}.adapter.linear_in.weight", "out": f"{module}.adapter.linear_out.weight"}
    if kind == "self_attention.linear_qkv":
        outs = _split_qkv(lora_b, mcfg)
        targets = {f"{layer}.self_attn.{p}": outs[p] for p in ("q_proj", "k_proj", "v_proj")}
    elif kind == "mlp.linear_fc1":
        gate, up = _split_gate_up(lora_b, mpu.get_tensor_model_parallel_world_size())
        targets = {f"{layer}.mlp.gate_proj": gate, f"{layer}.mlp.up_proj": up}
    elif kind == "self_attention.linear_proj":
        targets = {f"{layer}.self_attn.o_proj": lora_b}
    else:
        targets = {f"{layer}.mlp.down_proj": lora_b}
    for target, out in targets.items():
        yield f"{target}.lora_A.weight", lora_a.clone(), names["in"]
        yield f"{target}.lora_B.weight", out.contiguous(), names["out"]


def _split_qkv(lora_b: torch.Tensor, mcfg) -> dict[str, torch.Tensor]:
    groups, head_dim = mcfg.num_query_groups or mcfg.num_attention_heads, mcfg.kv_channels
    per_group = mcfg.num_attention_heads // groups
    grouped = lora_b.reshape(groups, (per_group + 2) * head_dim, lora_b.shape[-1])
    q = grouped[:, : per_group * head_dim].reshape(-1, lora_b.shape[-1])
    k = grouped[:, per_group * head_dim : (per_group + 1) * head_dim].reshape(-1, lora_b.shape[-1])
    v = grouped[:, (per_group + 1) * head_dim :].reshape(-1, lora_b.shape[-1])
    return {"q_proj": q, "k_proj": k, "v_proj": v}


def _split_gate_up(lora_b: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [shard.chunk(2, dim=0) for shard in lora_b.chunk(tp, dim=0)]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def _all_gather_json(obj, group) -> list:
    payload = torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(gathered, sizes, strict=True)]
