"""The tiny HF bases for PEFT checks: a `Qwen2ForCausalLM` built from a `Qwen2Config` (or a
`LlamaForCausalLM` from a `LlamaConfig`, for the real Megatron-Bridge tests), no hub access.

The Qwen2 base's module shapes are those of `qwen2_model.Qwen2SimConfig`, so an adapter exported
from the harness's Qwen2-shaped megatron model loads onto it. Weights are seeded (deterministic) and saved as
safetensors with `save_pretrained`; `AutoModelForCausalLM.from_pretrained(path)` loads it back.
transformers is imported only when a function runs.
"""

from __future__ import annotations

import os
from pathlib import Path


def offline() -> None:
    """Forbid hub access for this process (set before transformers/peft are imported or used)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


ARCHITECTURES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}


def build_tiny_qwen2(path: str | os.PathLike, config_kwargs: dict, *, seed: int = 0) -> Path:
    """Write a seeded `Qwen2ForCausalLM` with `Qwen2Config(**config_kwargs)` to `path`; returns it."""
    return build_tiny(path, "qwen2", config_kwargs, seed=seed)


def build_tiny(path: str | os.PathLike, family: str, config_kwargs: dict, *, seed: int = 0) -> Path:
    """Write a seeded HF causal LM of `family` ("qwen2" or "llama", see ARCHITECTURES) built from its
    config class with `config_kwargs` to `path`; returns it."""
    offline()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config_class, architecture = ARCHITECTURES[family]
    config = getattr(transformers, config_class)(**config_kwargs)
    config.architectures = [architecture]
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # from_config leaves some weights at zero/one: make every linear matter
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5)
    finally:
        torch.random.set_rng_state(generator_state)
    path = Path(path)
    model.save_pretrained(path)
    return path
