"""Offline PEFT export of a committed generation (`miles-lora-ckpt export-peft`): no live model.

It runs in one process. Both cases publish through `export.export_peft` into an export root.

1. The generation holds `peft/` (saved with `peft=`), or the two PEFT files at its top (a
   multi-LoRA slot saved with `peft_prefix=""`). Those files are verified against the manifest,
   self-checked, and republished as they are.
2. Otherwise its Megatron adapter shards are converted here, for a dense Qwen2/Llama-style
   decoder with Bridge-style `adapter.linear_in/linear_out`. TP shards are merged along the
   dimension their shapes show. Pipeline stages are numbered by an even split of the HF config's
   layers. Fused QKV is split per query group, and fused fc1 per TP shard into gate/up, as
   Bridge does. The HF base's `config.json` (`--base`) gives heads, query groups and head size.

Expert adapters, virtual pipeline chunks, uneven pipeline splits and unknown module names are
refused: they need the live model, so export with Bridge instead.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import torch

from miles_lora_ckpt.core import json_files
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.verify import check_file_content, resolve
from miles_lora_ckpt.megatron.bridge_export import ExportedWeight
from miles_lora_ckpt.savers.peft_export import format as fmt
from miles_lora_ckpt.savers.peft_export.convert import StaticSource
from miles_lora_ckpt.savers.peft_export.export import GENERATION_SUBDIR, export_peft

_SHARD_RE = re.compile(r"adapter/dense_tp([0-9]+)_pp([0-9]+)\.safetensors\Z", re.ASCII)
_NAME_RE = re.compile(
    r"chunk([0-9]+)\.decoder\.layers\.([0-9]+)\."
    r"(self_attention\.linear_qkv|self_attention\.linear_proj|mlp\.linear_fc1|mlp\.linear_fc2)"
    r"\.adapter\.(linear_in|linear_out)\.weight\Z",
    re.ASCII,
)

__all__ = ["OfflineExportError", "convert_shards", "export_generation"]


class OfflineExportError(MilesLoraCkptError, ValueError):
    """The generation cannot be exported without a live model (the message says why)."""


def export_generation(
    path: str | os.PathLike,
    out_root: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    lora_alpha: float | None = None,
    keep: int | None = None,
) -> Path:
    """Export the generation `path` stands for into the export root `out_root`.

    `path` is a save root (its newest intact generation) or one generation. `base` is the HF base
    model directory, needed to convert shards; `lora_alpha` overrides the saved alpha there. `keep`
    prunes the export root afterwards. Returns the published adapter directory. Raises
    OfflineExportError when the generation needs a live model, and the verifier's errors for a
    damaged one.
    """
    gen = resolve(Path(path)).generation  # verified: every byte, under the loader's rules
    manifest = gen.manifest
    weights_rel, config_rel = GENERATION_SUBDIR + fmt.WEIGHTS_NAME, GENERATION_SUBDIR + fmt.CONFIG_NAME
    if not (weights_rel in manifest.files and config_rel in manifest.files):  # a slot generation's top
        weights_rel, config_rel = fmt.WEIGHTS_NAME, fmt.CONFIG_NAME
    if weights_rel in manifest.files and config_rel in manifest.files:
        weights, config = _committed_export(gen.path, manifest, weights_rel, config_rel)
        lora = fmt.LoraSpec(
            r=config["r"],
            alpha=config["lora_alpha"],
            dropout=config.get("lora_dropout", 0.0),
            base_model_name_or_path=config.get("base_model_name_or_path") or "",
        )
        source = StaticSource(weights, kind="checkpoint-peft")
    else:
        if base is None:
            raise OfflineExportError(
                f"{gen.path} holds no {GENERATION_SUBDIR} export; converting its Megatron adapter shards needs "
                "the HF base's config.json: pass --base HF_MODEL_DIR"
            )
        weights, lora = convert_shards(gen.path, manifest, Path(base), lora_alpha)
        source, config = StaticSource(weights, kind="offline-shards"), None
    if not weights:
        raise OfflineExportError(f"{gen.path}: the adapter is empty; refusing to export it")
    return export_peft(
        None,
        out_root,
        source=source,
        lora=lora,
        iteration=manifest.iteration,
        consensus=Consensus.single_process(),
        topology=manifest.topology,
        keep=keep,
        config=config,
    )


def _committed_export(gen_dir: Path, manifest, weights_rel: str, config_rel: str):
    state = check_file_content(gen_dir, weights_rel, manifest).tensors()  # digest, stamp, binding, finiteness
    config = check_file_content(gen_dir, config_rel, manifest).value
    if not isinstance(config, dict):
        raise OfflineExportError(f"{gen_dir / config_rel}: not a JSON object")
    weights = [ExportedWeight(fmt.unprefixed(key), tensor.clone()) for key, tensor in sorted(state.items())]
    return weights, config


# ---------------------------------------------------------------------- Megatron shards -> HF names


def convert_shards(gen_dir: Path, manifest, base: Path, lora_alpha: float | None):
    """`(HF-named adapter weights, LoraSpec)` from a single-LoRA generation's dense shards.

    Raises OfflineExportError for what only a live model can convert (see above).
    """
    topology = manifest.topology
    if topology.vpp != 1:
        raise OfflineExportError(f"virtual pipeline chunks (vpp={topology.vpp}) need the live model's layer map")
    if any(rel.startswith("adapter/expert_") for rel in manifest.files):
        raise OfflineExportError("expert adapters need the live model (Bridge's expert mapping); export with Bridge")
    try:
        hf = json_files.read_json(base / "config.json")
    except ValueError as exc:  # a FIFO or device is refused without being opened; named either way
        raise OfflineExportError(f"{base / 'config.json'}: {exc}") from None
    heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    dims = {
        "hidden": int(hf["hidden_size"]),
        "heads": heads,
        "groups": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "ffn": int(hf["intermediate_size"]),
    }
    if layers % topology.pp:
        raise OfflineExportError(f"{layers} layers do not split evenly over pp={topology.pp}; need the live model")
    shards = _read_shards(gen_dir, manifest)  # {(tp, pp): {name: tensor}}
    modules: dict[tuple[int, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (tp_rank, pp_rank), tensors in sorted(shards.items()):
        for name, tensor in tensors.items():
            match = _NAME_RE.match(name)
            if match is None:
                raise OfflineExportError(f"{name}: no offline mapping for this adapter name; export with Bridge")
            layer = int(match.group(2)) + pp_rank * (layers // topology.pp)
            modules[(layer, match.group(3))][match.group(4)].append((tp_rank, tensor))
    lora_meta = manifest.metadata.get("lora", {}) if isinstance(manifest.metadata, dict) else {}
    r = _rank(lora_meta, modules, topology.tp)
    alpha = lora_alpha if lora_alpha is not None else lora_meta.get("lora_alpha")
    if alpha is None:
        raise OfflineExportError("lora_alpha is not recorded in the generation's metadata: pass --lora-alpha")
    weights = []
    for (layer, kind), factors in sorted(modules.items()):
        full = {
            which: _merge(kind, which, factors[which], topology.tp, r, dims) for which in ("linear_in", "linear_out")
        }
        weights += _to_hf(layer, kind, full["linear_in"], full["linear_out"], topology.tp, dims)
    lora = fmt.LoraSpec(
        r=r, alpha=float(alpha), dropout=float(lora_meta.get("lora_dropout", 0.0)), base_model_name_or_path=str(base)
    )
    return weights, lora


def _read_shards(gen_dir: Path, manifest) -> dict[tuple[int, int], dict]:
    shards = {}
    for rel in sorted(manifest.files):
        match = _SHARD_RE.match(rel)
        if match:
            shards[(int(match.group(1)), int(match.group(2)))] = check_file_content(gen_dir, rel, manifest).tensors()
    return shards


def _full_shape(kind: str, which: str, r: int, dims: dict) -> list[int]:
    qkv = (dims["heads"] + 2 * dims["groups"]) * dims["head_dim"]
    in_out = {
        "self_attention.linear_qkv": (dims["hidden"], qkv),
        "self_attention.linear_proj": (dims["heads"] * dims["head_dim"], dims["hidden"]),
        "mlp.linear_fc1": (dims["hidden"], 2 * dims["ffn"]),
        "mlp.linear_fc2": (dims["ffn"], dims["hidden"]),
    }[kind]
    return [r, in_out[0]] if which == "linear_in" else [in_out[1], r]


def _rank(lora_meta: dict, modules: dict, tp: int) -> int:
    if isinstance(lora_meta.get("lora_rank"), int):
        return lora_meta["lora_rank"]
    for (_, kind), factors in modules.items():  # a row-parallel base's linear_in never splits its rank
        if kind in ("self_attention.linear_proj", "mlp.linear_fc2") and factors["linear_in"]:
            return int(factors["linear_in"][0][1].shape[0])
    raise OfflineExportError("the LoRA rank is not recorded and cannot be read from the shards")


def _merge(kind: str, which: str, shards: list, tp: int, r: int, dims: dict):
    """The full tensor from its TP shards.

    Replicated when a shard has the full shape, else concatenated along the one dimension that is
    1/tp of the full size.
    """
    name = f"layer {kind}.adapter.{which}"
    full = _full_shape(kind, which, r, dims)
    if len(shards) != tp:
        raise OfflineExportError(f"{name}: {len(shards)} tensor-parallel shards, the generation has tp={tp}")
    tensors = [t for _, t in sorted(shards, key=lambda item: item[0])]
    shape = list(tensors[0].shape)
    if shape == full:
        if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
            raise OfflineExportError(f"{name}: replicated shards differ between tensor-parallel ranks")
        return tensors[0]
    split = [d for d in range(2) if shape[d] * tp == full[d] and shape[1 - d] == full[1 - d]]
    if len(split) != 1:
        raise OfflineExportError(f"{name}: shard shape {shape} fits neither {full} nor a 1/{tp} split of it")
    return torch.cat(tensors, dim=split[0])


def _to_hf(layer: int, kind: str, lora_a, lora_b, tp: int, dims: dict) -> list[ExportedWeight]:
    prefix = f"model.layers.{layer}"
    if kind == "self_attention.linear_qkv":
        per_group, head_dim, rank = dims["heads"] // dims["groups"], dims["head_dim"], lora_b.shape[1]
        grouped = lora_b.reshape(dims["groups"], (per_group + 2) * head_dim, rank)
        bounds = {
            "q_proj": (0, per_group),
            "k_proj": (per_group, per_group + 1),
            "v_proj": (per_group + 1, per_group + 2),
        }
        outs = {
            f"self_attn.{p}": grouped[:, lo * head_dim : hi * head_dim].reshape(-1, rank)
            for p, (lo, hi) in bounds.items()
        }
    elif kind == "mlp.linear_fc1":
        halves = [shard.chunk(2, dim=0) for shard in lora_b.chunk(tp, dim=0)]
        outs = {"mlp.gate_proj": torch.cat([h[0] for h in halves]), "mlp.up_proj": torch.cat([h[1] for h in halves])}
    elif kind == "self_attention.linear_proj":
        outs = {"self_attn.o_proj": lora_b}
    else:
        outs = {"mlp.down_proj": lora_b}
    weights = []
    for target, out in outs.items():
        weights.append(ExportedWeight(f"{prefix}.{target}{fmt.LORA_A}", lora_a.clone()))
        weights.append(ExportedWeight(f"{prefix}.{target}{fmt.LORA_B}", out.contiguous().clone()))
    return weights
