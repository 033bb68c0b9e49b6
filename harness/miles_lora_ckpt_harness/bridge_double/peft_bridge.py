"""TEST DOUBLE of `megatron.bridge.models.conversion.peft_bridge`: the four documented pure helpers.

Written from Bridge's documentation, not from its source. HF names without PEFT's
prefix in, PEFT keys (`base_model.model.` + name) out; `lora_A` is [r, in], `lora_B` [out, r]. The
double packs no fused 3-D expert stacks (it raises); the exporter refuses those before converting.
"""

from __future__ import annotations

from typing import Any

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def _split(name: str) -> tuple[str, str]:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    raise ValueError(f"not an adapter weight name: {name}")


def convert_adapter_weights_to_peft_state(adapter_weights) -> tuple[dict, list[str], list[str]]:
    """`(state_dict with base_model.model. keys, module weight names, target_parameters)`."""
    state, names = {}, []
    for item in adapter_weights:
        if item.weight.ndim == 3:
            raise NotImplementedError("the Bridge double does not pack 3-D expert stacks")
        state[f"base_model.model.{item.param_name}"] = item.weight
        names.append(item.param_name)
    return state, names, []


def infer_target_modules_from_adapter_weights(adapter_weight_names) -> list[str]:
    """Sorted unique last components of the adapted modules (`q_proj`, `gate_proj`, ...)."""
    return sorted({_split(name)[0].rsplit(".", 1)[-1] for name in adapter_weight_names})


def infer_rank_pattern_from_adapter_weights(adapter_weights, *, default_rank: int) -> dict[str, int]:
    """`{module path: rank}` for targets whose lora_A rank differs from `default_rank`."""
    ranks: dict[str, int] = {}
    for item in adapter_weights:
        base, suffix = _split(item.param_name)
        if suffix != ".lora_A.weight":
            continue
        rank = item.weight.shape[1] if item.weight.ndim == 3 else item.weight.shape[0]
        if base in ranks and ranks[base] != rank:
            raise ValueError(f"Inconsistent LoRA ranks detected for target {base}: saw {ranks[base]} and {rank}")
        ranks[base] = rank
    return {base: rank for base, rank in ranks.items() if rank != default_rank}


def build_adapter_config_dict(
    peft_config,
    target_modules,
    target_parameters=None,
    base_model_name_or_path=None,
    rank_pattern=None,
) -> dict[str, Any]:
    """An `adapter_config.json` dict; `peft_config` has `dim`, `alpha`, `dropout`."""
    config = {
        "peft_type": "LORA",
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path or "",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": getattr(peft_config, "alpha", 32),
        "lora_dropout": 0.0 if target_parameters else getattr(peft_config, "dropout", 0.0),
        "modules_to_save": None,
        "r": getattr(peft_config, "dim", 32),
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": {},
        "target_modules": target_modules,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    if target_parameters:
        config["target_parameters"] = target_parameters
    return config
